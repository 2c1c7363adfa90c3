//! A minimal HTTP/1.1 client over one keep-alive TCP connection, for the load generator and the
//! real-socket tests. It speaks just enough HTTP for this API: `Content-Length` bodies, no
//! chunked encoding, no TLS. Every read is bounded by a timeout.

use std::io::IoSlice;
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
        // Head and body in one write where the socket takes them (a head sent alone would reach
        // the server as a segment of its own, and wake it once more for the body).
        let stream = self.stream.get_mut();
        let mut slices: Vec<IoSlice<'_>> = std::iter::once(&self.head[..])
            .chain(rest.iter().copied().filter(|b| !b.is_empty()))
            .map(IoSlice::new)
            .collect();
        let mut unsent = &mut slices[..];
        while !unsent.is_empty() {
            let written = stream.write_vectored(unsent).await?;
            if written == 0 {
                return Err(ClientError::Io(std::io::ErrorKind::WriteZero.into()));
            }
            IoSlice::advance_slices(&mut unsent, written);
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A server that reads one request at a time, slowly, and answers with the body it got.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut stream = BufReader::with_capacity(1024, stream);
            loop {
                let mut length = 0usize;
                let mut line = String::new();
                loop {
                    line.clear();
                    if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    if line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.strip_prefix("content-length: ") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0u8; length];
                for chunk in body.chunks_mut(1_000_000) {
                    // Read in small steps, so that the client's writes come back partial.
                    stream.read_exact(chunk).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n");
                let out = stream.get_mut();
                out.write_all(head.as_bytes()).await.unwrap();
                out.write_all(&body).await.unwrap();
            }
        });
        addr
    }

    #[tokio::test]
    async fn bodies_in_pieces_arrive_whole_through_partial_writes() {
        let addr = echo_server().await;
        let mut client = HttpClient::connect(addr).await.unwrap();
        let big: Vec<u8> = (0..12_000_000u32).map(|i| (i % 251) as u8).collect();
        let small = b"{\"a\":";
        for pieces in [
            vec![&small[..], &big[..], &b"}"[..]],
            vec![&big[..1], &b""[..], &big[1..2_000_000]],
            vec![&small[..]],
        ] {
            let (status, echoed) = client.request_parts("POST", "/x", &pieces).await.unwrap();
            assert_eq!(status, 200);
            assert_eq!(echoed, pieces.concat());
        }
        let (status, echoed) = client.request("GET", "/y", None).await.unwrap();
        assert_eq!((status, echoed.len()), (200, 0));
    }
}
