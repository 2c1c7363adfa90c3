//! A `nats-server` of a test's own (the Debian package's binary), on 127.0.0.1 with a free port
//! and a temporary JetStream store, killed when dropped. Shared by the replica-sync tests of
//! `kvroute-service` and the docs/replicas.md test of the `kvroute` binary (`#[path]`-included).
//!
//! The binary: `KVROUTE_NATS_SERVER`, else `nats-server` on the PATH, else
//! `/usr/sbin/nats-server`; without one the test fails and says how to install it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KVROUTE_NATS_SERVER") {
        return PathBuf::from(path);
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("nats-server"))
                .find(|candidate| candidate.is_file())
        })
        .unwrap_or_default();
    let found = on_path.or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/nats-server");
        sbin.is_file().then_some(sbin)
    });
    found.unwrap_or_else(|| {
        panic!(
            "nats-server not found (looked at $KVROUTE_NATS_SERVER, the PATH and \
             /usr/sbin/nats-server): install it with `apt-get install nats-server` \
             (scripts/deps.sh does) or point KVROUTE_NATS_SERVER at the binary"
        )
    })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Nats {
    child: Option<Child>,
    port: u16,
    store: PathBuf,
}

impl Nats {
    pub fn start() -> Self {
        static STARTED: AtomicU64 = AtomicU64::new(0);
        let store = std::env::temp_dir().join(format!(
            "kvroute-nats-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&store);
        std::fs::create_dir_all(&store).unwrap();
        let mut nats = Self {
            child: None,
            port: free_port(),
            store,
        };
        nats.restart();
        nats
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again, on the same port and store), waiting until it accepts.
    pub fn restart(&mut self) {
        let child = Command::new(nats_server_binary())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server and deletes its store (a server that lost its data).
    pub fn stop_and_wipe(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
        std::fs::create_dir_all(&self.store).unwrap();
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
