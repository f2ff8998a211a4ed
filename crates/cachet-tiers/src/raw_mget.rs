//! A load's `MGET` on a plain `redis://` server without the `redis` crate's reply parser: the
//! reply is read straight into one reused buffer and each value is checked as soon as its bytes
//! are in, while the rest of the reply is still arriving.
//!
//! **Why not the crate.** `redis` parses a reply into a `Value` tree: every bulk string is copied
//! out of its codec buffer into a fresh `Vec<u8>`. A 2,000-token prompt's load is 124 values of
//! 368 KB (45.7 MB): 124 allocations above glibc's mmap threshold, so a new mapping each, faulted
//! in page by page (about 11,000 minor faults per load, all on the tier thread, measured with
//! `/proc/<pid>/task/*/stat`), then a second pass over the bytes to verify them. Here the reply
//! lands in a [`BytesMut`] that is reused from one load to the next (once the engine has dropped
//! the previous load's payloads, [`BytesMut::reserve`] takes the same allocation back), the
//! payloads are zero-copy [`Bytes`] slices of it, and verification overlaps the transfer.
//!
//! Only what a load needs of RESP: `AUTH` / `SELECT` at connect, and the reply of one `MGET`
//! (an array of bulk strings or nils, or an error). Everything else (lookups, saves, probes, a
//! cluster, TLS) stays on the `redis` crate's connection.

use std::ops::Range;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use redis::{ConnectionAddr, ConnectionInfo, ErrorKind, RedisError, RedisResult, ServerErrorKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where a raw connection goes and how it logs in (from a `redis://` URL).
#[derive(Clone, Debug)]
pub(crate) struct RawTarget {
    host: String,
    port: u16,
    db: i64,
    username: Option<String>,
    password: Option<String>,
}

impl RawTarget {
    /// The raw target of a single-server URL: `redis://` over TCP only (`rediss://` and unix
    /// sockets keep the crate's path).
    pub(crate) fn from_url(url: &str) -> Option<RawTarget> {
        if !url.starts_with("redis://") {
            return None;
        }
        let client = redis::Client::open(url).ok()?;
        let info: &ConnectionInfo = client.get_connection_info();
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return None;
        };
        let r = info.redis_settings();
        Some(RawTarget {
            host: host.clone(),
            port: *port,
            db: r.db(),
            username: r.username().map(str::to_owned),
            password: r.password().map(str::to_owned),
        })
    }
}

fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn protocol_error(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::UnexpectedReturnType, what))
}

fn error_reply(line: &[u8]) -> RedisError {
    RedisError::from((
        ErrorKind::Server(ServerErrorKind::ResponseError),
        "Redis answered an error",
        String::from_utf8_lossy(line)
            .chars()
            .take(120)
            .collect::<String>(),
    ))
}

/// The position of the `\r\n` ending the line that starts at `from`, if it is in `buf`.
fn line_end(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?
        .windows(2)
        .position(|w| w == b"\r\n")
        .map(|p| from + p)
}

fn parse_int(s: &[u8]) -> Option<i64> {
    std::str::from_utf8(s).ok()?.parse().ok()
}

/// One `MGET` reply's element: a value's byte range in the reply buffer and what `check`
/// said of it, or `None` for a key that is absent.
pub(crate) type Element<T> = Option<(Range<usize>, T)>;

/// A connection used only for loads.
pub(crate) struct RawConn {
    stream: TcpStream,
    buf: BytesMut,
    /// The largest value seen, to size the next reply's buffer at once.
    value_hint: usize,
}

impl RawConn {
    /// Connects, logs in (`AUTH`) and selects the database, bounded by `timeout`.
    pub(crate) async fn connect(t: &RawTarget, timeout: Duration) -> RedisResult<RawConn> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect((t.host.as_str(), t.port)))
            .await
            .map_err(|_| RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut)))??;
        stream.set_nodelay(true)?;
        let mut c = RawConn {
            stream,
            buf: BytesMut::with_capacity(64 << 10),
            value_hint: 0,
        };
        if let Some(pw) = &t.password {
            match &t.username {
                Some(u) => c.simple(&[b"AUTH", u.as_bytes(), pw.as_bytes()]).await?,
                None => c.simple(&[b"AUTH", pw.as_bytes()]).await?,
            }
        }
        if t.db != 0 {
            c.simple(&[b"SELECT", t.db.to_string().as_bytes()]).await?;
        }
        Ok(c)
    }

    /// Sends a command whose answer must be `+OK`.
    async fn simple(&mut self, args: &[&[u8]]) -> RedisResult<()> {
        self.stream.write_all(&command(args)).await?;
        self.buf.clear();
        loop {
            if let Some(end) = line_end(&self.buf, 0) {
                let line = &self.buf[..end];
                let ok = line == b"+OK";
                let err = (!ok).then(|| error_reply(line));
                self.buf.clear();
                return err.map_or(Ok(()), Err);
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
    }

    /// `MGET keys`: the reply's bytes and, per key in order, where its value lies in them and
    /// what `check(index, value)` returned for it — called as soon as the value is complete,
    /// while the rest of the reply is still arriving.
    pub(crate) async fn mget<T>(
        &mut self,
        keys: &[Vec<u8>],
        mut check: impl FnMut(usize, &[u8]) -> T,
    ) -> RedisResult<(Bytes, Vec<Element<T>>)> {
        let mut args: Vec<&[u8]> = Vec::with_capacity(keys.len() + 1);
        args.push(b"MGET");
        args.extend(keys.iter().map(Vec::as_slice));
        self.stream.write_all(&command(&args)).await?;
        // Back to the start of the buffer; the allocation is reused when the previous reply's
        // payloads are all gone, else a fresh one is made (the payloads keep theirs).
        self.buf.clear();
        let hint = keys.len() * (self.value_hint + 32) + 64;
        self.buf.reserve(hint);
        let mut out: Vec<Element<T>> = Vec::with_capacity(keys.len());
        let mut pos = 0usize;
        let mut count: Option<usize> = None;
        // Bytes still missing for the element being read (for reserving).
        let mut missing = 0usize;
        loop {
            // Parse what is complete.
            loop {
                let n = match count {
                    Some(n) => n,
                    None => {
                        let Some(end) = line_end(&self.buf, pos) else {
                            break;
                        };
                        let line = &self.buf[pos..end];
                        match line.first() {
                            Some(b'*') => {
                                let n = parse_int(&line[1..])
                                    .and_then(|n| usize::try_from(n).ok())
                                    .ok_or_else(|| protocol_error("MGET: bad array header"))?;
                                if n != keys.len() {
                                    return Err(protocol_error(
                                        "MGET answered the wrong number of values",
                                    ));
                                }
                                count = Some(n);
                                pos = end + 2;
                                n
                            }
                            Some(b'-') => return Err(error_reply(&line[1..])),
                            _ => return Err(protocol_error("MGET did not answer an array")),
                        }
                    }
                };
                if out.len() == n {
                    if pos != self.buf.len() {
                        return Err(protocol_error("MGET: bytes after the reply"));
                    }
                    let reply = self.buf.split().freeze();
                    return Ok((reply, out));
                }
                let Some(end) = line_end(&self.buf, pos) else {
                    break;
                };
                let line = &self.buf[pos..end];
                if line.first() != Some(&b'$') {
                    // Another type under our key is not a value of ours.
                    return Err(protocol_error("MGET: an element is not a bulk string"));
                }
                let len =
                    parse_int(&line[1..]).ok_or_else(|| protocol_error("MGET: bad length"))?;
                if len < 0 {
                    out.push(None);
                    pos = end + 2;
                    continue;
                }
                let len = len as usize;
                let start = end + 2;
                let stop = start + len;
                if self.buf.len() < stop + 2 {
                    missing = stop + 2 - self.buf.len();
                    break;
                }
                if &self.buf[stop..stop + 2] != b"\r\n" {
                    return Err(protocol_error("MGET: a value is not followed by CRLF"));
                }
                self.value_hint = self.value_hint.max(len);
                let verdict = check(out.len(), &self.buf[start..stop]);
                out.push(Some((start..stop, verdict)));
                pos = stop + 2;
                missing = 0;
            }
            // Room for at least the rest of the element in progress.
            let want = missing.max(256 << 10);
            if self.buf.capacity() - self.buf.len() < want {
                self.buf.reserve(want);
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        assert_eq!(
            command(&[b"MGET", b"a", b"bc"]),
            b"*3\r\n$4\r\nMGET\r\n$1\r\na\r\n$2\r\nbc\r\n".to_vec()
        );
    }

    #[test]
    fn urls_map_to_raw_targets() {
        let t = RawTarget::from_url("redis://u:pw@127.0.0.1:7000/3").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.db), ("127.0.0.1", 7000, 3));
        assert_eq!(
            (t.username.as_deref(), t.password.as_deref()),
            (Some("u"), Some("pw"))
        );
        assert!(RawTarget::from_url("rediss://127.0.0.1:7000").is_none());
    }

    /// A fake server answering one canned reply, dribbled in pieces of `chunk` bytes.
    async fn serve_once(reply: Vec<u8>, chunk: usize) -> RawTarget {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = [0u8; 4096];
            let _ = s.read(&mut req).await.unwrap();
            for piece in reply.chunks(chunk) {
                s.write_all(piece).await.unwrap();
                s.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
            // Keep the socket open until the client is done.
            let _ = s.read(&mut req).await;
        });
        RawTarget {
            host: "127.0.0.1".into(),
            port,
            db: 0,
            username: None,
            password: None,
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_reply_split_anywhere_gives_every_value_and_nil_in_order() {
        let reply = b"*3\r\n$5\r\nhello\r\n$-1\r\n$0\r\n\r\n".to_vec();
        for chunk in [1, 2, 3, 7, 100] {
            rt().block_on(async {
                let t = serve_once(reply.clone(), chunk).await;
                let mut c = RawConn::connect(&t, Duration::from_secs(5)).await.unwrap();
                let keys = vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()];
                let mut seen = Vec::new();
                let (bytes, els) = c
                    .mget(&keys, |i, v| {
                        seen.push((i, v.to_vec()));
                        v.len()
                    })
                    .await
                    .unwrap();
                assert_eq!(seen, vec![(0, b"hello".to_vec()), (2, Vec::new())]);
                assert_eq!(els.len(), 3);
                let (r0, n0) = els[0].clone().unwrap();
                assert_eq!((&bytes[r0], n0), (&b"hello"[..], 5));
                assert!(els[1].is_none());
                let (r2, n2) = els[2].clone().unwrap();
                assert_eq!((r2.len(), n2), (0, 0));
            });
        }
    }

    #[test]
    fn error_replies_wrong_counts_and_other_types_are_errors() {
        rt().block_on(async {
            let keys = vec![b"a".to_vec(), b"b".to_vec()];
            let t = serve_once(b"-ERR no\r\n".to_vec(), 100).await;
            let mut c = RawConn::connect(&t, Duration::from_secs(5)).await.unwrap();
            let e = c.mget(&keys, |_, _| ()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Server(ServerErrorKind::ResponseError));

            let t = serve_once(b"*1\r\n$1\r\nx\r\n".to_vec(), 100).await;
            let mut c = RawConn::connect(&t, Duration::from_secs(5)).await.unwrap();
            let e = c.mget(&keys, |_, _| ()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::UnexpectedReturnType);

            let t = serve_once(b"*2\r\n:1\r\n$1\r\nx\r\n".to_vec(), 100).await;
            let mut c = RawConn::connect(&t, Duration::from_secs(5)).await.unwrap();
            let e = c.mget(&keys, |_, _| ()).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::UnexpectedReturnType);
        });
    }
}
