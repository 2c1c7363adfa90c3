//! The log lines a test process writes, captured: [`capture`] installs (once per process) a
//! global `tracing` subscriber at INFO that keeps every line in memory, bounded, so a test can
//! check that a warning was written. Tests of one binary share it: search for what names your
//! own test's objects (a worker id no other test uses).

use parking_lot::Mutex;
use std::io::Write;
use std::sync::{Arc, OnceLock};

/// The most bytes kept; older lines are dropped past it.
const MAX_BYTES: usize = 8 << 20;

/// The captured lines of this process.
#[derive(Clone, Debug, Default)]
pub struct Logs {
    buffer: Arc<Mutex<Vec<u8>>>,
}

impl Logs {
    /// The lines captured so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.buffer.lock()).into_owned();
        text.lines()
            .filter(|line| line.contains(needle))
            .map(str::to_string)
            .collect()
    }
}

struct Writer(Arc<Mutex<Vec<u8>>>);

impl Write for Writer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let mut buffer = self.0.lock();
        if buffer.len() + bytes.len() > MAX_BYTES {
            let cut = (buffer.len() / 2).max(bytes.len().min(buffer.len()));
            buffer.drain(..cut);
        }
        buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// This process's captured logs, capturing from the first call on. When another subscriber
/// was installed first, nothing is captured (and [`Logs::lines_with`] finds nothing).
pub fn capture() -> Logs {
    static LOGS: OnceLock<Logs> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Logs::default();
        let buffer = Arc::clone(&logs.buffer);
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || Writer(Arc::clone(&buffer)))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        logs
    })
    .clone()
}
