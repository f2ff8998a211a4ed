//! The accept loop: HTTP/1.1 connections served by hyper with a header-read timer, at most
//! `--max-connections` at once, and graceful shutdown.
//!
//! `axum::serve` installs no timer, so hyper's header-read timeout never fires there: a client
//! sending its headers a byte a second kept its connection (and a file descriptor) forever.
//! Here every connection gets hyper's `TokioTimer` and `header_read_timeout`, which also closes
//! a keep-alive connection that stays idle that long between requests. Connections beyond
//! `--max-connections` are not accepted until one closes (they wait in the kernel's backlog
//! instead of costing a descriptor each), and an accept error (`EMFILE` when the process is out
//! of descriptors) pauses the loop briefly instead of ending it.
//!
//! On shutdown the listener closes, idle connections close at once, busy ones after their
//! response, and [`run`] returns when the last one is gone.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// The connection limits of [`run`].
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// `None`: no header-read (and keep-alive idle) limit.
    pub header_read_timeout: Option<Duration>,
    pub max_connections: usize,
}

/// Descriptors kept free for everything but client connections (model file, engine, logs,
/// the listener itself, outgoing tier connections).
const RESERVED_FDS: u64 = 64;

/// `wanted`, lowered to what the process's descriptor limit leaves for connections. Raises the
/// soft limit towards the hard one first when that is needed.
pub fn fit_to_fd_limit(wanted: usize) -> usize {
    let wanted = wanted.max(1);
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit only read and write the struct passed.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return wanted;
        }
        let need = wanted as u64 + RESERVED_FDS;
        if lim.rlim_cur != libc::RLIM_INFINITY && lim.rlim_cur < need {
            let raised = libc::rlimit {
                rlim_cur: need.min(lim.rlim_max),
                rlim_max: lim.rlim_max,
            };
            // SAFETY: as above.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                lim.rlim_cur = raised.rlim_cur;
            }
        }
        if lim.rlim_cur == libc::RLIM_INFINITY {
            return wanted;
        }
        let fits = lim.rlim_cur.saturating_sub(RESERVED_FDS).max(1);
        if (wanted as u64) > fits {
            tracing::warn!(
                wanted,
                fd_limit = lim.rlim_cur,
                using = fits,
                "--max-connections lowered to fit the file descriptor limit"
            );
            return fits as usize;
        }
        wanted
    }
    #[cfg(not(unix))]
    wanted
}

/// Serves `app` on `listener` until `stop` resolves, then shuts down gracefully and returns
/// once every connection has closed.
pub async fn run(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let max = limits
        .max_connections
        .clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize));
    let slots = Arc::new(Semaphore::new(max));
    let (closing_tx, closing_rx) = watch::channel(false);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let builder = Arc::new(builder);
    tokio::pin!(stop);
    loop {
        // A free slot first, so a connection over the limit is not even accepted.
        let slot = tokio::select! {
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = &mut stop => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    if !is_per_connection_error(&e) {
                        // Out of descriptors or memory: wait for some to be released.
                        tracing::error!(error = %e, "accept failed; retrying shortly");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = Arc::clone(&builder);
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let closed = async move {
                let _ = closing.wait_for(|c| *c).await;
            };
            let result = tokio::select! {
                r = conn.as_mut() => r,
                _ = closed => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                if e.is_timeout() {
                    tracing::debug!(%peer, "closed a connection: headers not received in time");
                } else {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
            }
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    // Every connection task holds a slot until it ends.
    let _ = slots.acquire_many(max as u32).await;
}

/// Errors that concern one connection only (the next accept may succeed at once).
fn is_per_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_limit_fits_the_descriptor_limit() {
        assert_eq!(fit_to_fd_limit(0), 1);
        assert_eq!(fit_to_fd_limit(16), 16);
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: reads into the struct.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        if lim.rlim_max != libc::RLIM_INFINITY {
            let most = (lim.rlim_max - RESERVED_FDS) as usize;
            assert_eq!(fit_to_fd_limit(usize::MAX / 2), most);
        }
    }
}
