//! One replay conversation with an engine's ROUTER socket (SPEC §3.1), run as its own task so
//! that the listener keeps reading — and buffering — live messages meanwhile.
//!
//! The task connects a DEALER, sends `[b"", start_seq]` and forwards every reply it reads into a
//! bounded channel (so a fast engine cannot outrun the listener by more than the channel's
//! capacity). The listener parses the replies, recognises the end marker and enforces the
//! deadline; dropping the [`Conversation`] aborts the task and closes the socket.

use super::zmq_message;
use bytes::Bytes;
use kvroute_wire::frames;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend};

/// Replies read but not yet handled by the listener.
const REPLY_CHANNEL_CAPACITY: usize = 256;

/// What the conversation task reports.
#[derive(Debug)]
pub(crate) enum ReplayItem {
    /// One multipart reply, as the DEALER received it.
    Reply(Vec<Bytes>),
    /// The conversation cannot go on (connect, send or receive failed).
    Failed(String),
}

/// A running replay conversation. Dropping it stops the task.
pub(crate) struct Conversation {
    pub replies: mpsc::Receiver<ReplayItem>,
    task: JoinHandle<()>,
}

impl Drop for Conversation {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts asking `address` for every buffered batch from `start_seq` on.
pub(crate) fn start(address: String, start_seq: u64, connect_timeout: Duration) -> Conversation {
    let (tx, replies) = mpsc::channel(REPLY_CHANNEL_CAPACITY);
    let task = tokio::spawn(async move {
        if let Err(reason) = converse(&address, start_seq, connect_timeout, &tx).await {
            // The listener may already have given up on this conversation.
            let _ = tx.send(ReplayItem::Failed(reason)).await;
        }
    });
    Conversation { replies, task }
}

async fn converse(
    address: &str,
    start_seq: u64,
    connect_timeout: Duration,
    tx: &mpsc::Sender<ReplayItem>,
) -> Result<(), String> {
    let mut options = SocketOptions::default();
    options.connect_timeout(connect_timeout);
    let mut dealer = DealerSocket::with_options(options);
    dealer
        .connect(address)
        .await
        .map_err(|e| format!("cannot connect to replay endpoint {address}: {e}"))?;
    let request = zmq_message(frames::replay_request(start_seq))
        .ok_or_else(|| "empty replay request".to_string())?;
    dealer
        .send(request)
        .await
        .map_err(|e| format!("cannot send replay request to {address}: {e}"))?;
    loop {
        let reply = dealer
            .recv()
            .await
            .map_err(|e| format!("replay endpoint {address} failed: {e}"))?;
        if tx.send(ReplayItem::Reply(reply.into_vec())).await.is_err() {
            // The listener finished with this conversation.
            return Ok(());
        }
    }
}
