//! A minimal HTTP/1.1 client over one keep-alive TCP connection, for the load generator and the
//! real-socket tests. It speaks just enough HTTP for this API: `Content-Length` bodies, no
//! chunked encoding, no TLS. Every read is bounded by a timeout.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("request timed out after {0:?}")]
    Timeout(Duration),
    #[error("malformed response: {0}")]
    Malformed(String),
}

pub struct HttpClient {
    addr: SocketAddr,
    stream: BufReader<TcpStream>,
    timeout: Duration,
    head: Vec<u8>,
}

impl HttpClient {
    pub async fn connect(addr: SocketAddr) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            addr,
            stream: BufReader::new(stream),
            timeout: Duration::from_secs(30),
            head: Vec::with_capacity(256),
        })
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sends one request and reads the response: `(status, body)`.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<(u16, Vec<u8>), ClientError> {
        match body {
            Some(b) => self.request_parts(method, path, &[b]).await,
            None => self.request_parts(method, path, &[]).await,
        }
    }

    /// Like [`request`](Self::request) with a JSON body given in pieces (sent back to back, not
    /// copied into one buffer); no pieces means no body.
    pub async fn request_parts(
        &mut self,
        method: &str,
        path: &str,
        body: &[&[u8]],
    ) -> Result<(u16, Vec<u8>), ClientError> {
        let timeout = self.timeout;
        match tokio::time::timeout(timeout, self.exchange(method, path, body)).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Timeout(timeout)),
        }
    }

    async fn exchange(
        &mut self,
        method: &str,
        path: &str,
        body: &[&[u8]],
    ) -> Result<(u16, Vec<u8>), ClientError> {
        use std::io::Write;
        self.head.clear();
        let _ = write!(
            self.head,
            "{method} {path} HTTP/1.1\r\nhost: {}\r\n",
            self.addr
        );
        if body.is_empty() {
            self.head.extend_from_slice(b"content-length: 0\r\n\r\n");
        } else {
            let length: usize = body.iter().map(|b| b.len()).sum();
            let _ = write!(
                self.head,
                "content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
            );
        }
        // Small pieces ride in the head's buffer; large ones are written as they are.
        let mut rest = body;
        while let Some((first, tail)) = rest.split_first()
            && first.len() <= 4096
        {
            self.head.extend_from_slice(first);
            rest = tail;
        }
        let stream = self.stream.get_mut();
        stream.write_all(&self.head).await?;
        for b in rest {
            stream.write_all(b).await?;
        }
        let mut line = String::new();
        if self.stream.read_line(&mut line).await? == 0 {
            return Err(ClientError::Malformed("connection closed".into()));
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| ClientError::Malformed(format!("status line {line:?}")))?;
        let mut length = 0usize;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(ClientError::Malformed(
                    "connection closed in headers".into(),
                ));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v
                    .trim()
                    .parse()
                    .map_err(|_| ClientError::Malformed(format!("content-length {v:?}")))?;
            }
        }
        let mut buf = vec![0u8; length];
        self.stream.read_exact(&mut buf).await?;
        Ok((status, buf))
    }
}
