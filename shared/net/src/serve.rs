//! The accept loop every server of the workspace runs (the relay, the daemon's LAN server and
//! its local API): connections accepted by our own loop and served by hyper's HTTP/1 server
//! (axum::serve has no header-read timeout: a client trickling its headers would hold a socket
//! forever), with a header-read timeout, a keep-alive idle timeout, a bound on open connections
//! and graceful shutdown ([`ConnSettings`]; the relay's values are the `wire.md` §3.1 ones,
//! the LAN server's §4).
//!
//! # What it owns
//! Accepting, the connection slots, the per-connection timers and the drain on shutdown. Every
//! request carries the peer's address as `axum::extract::ConnectInfo<SocketAddr>` and its
//! connection's slot as [`ConnSlot`].
//!
//! Connections may be upgraded (HTTP/1.1 `Upgrade`, e.g. a WebSocket): once hyper handed the
//! socket to the upgrade, the HTTP connection task ends, but the slot does not come back while
//! a holder of the request's [`ConnSlot`] keeps it. A handler that upgrades moves the
//! [`ConnSlot`] into the task that serves the upgraded socket, so an upgraded connection counts
//! against `max_connections` for its whole life.
//!
//! # What it must never do
//! Route, authenticate or answer a request itself (the router does), or log anything about a
//! request beyond the server's name and an error's text.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use axum::Router;

/// Pause after an accept error that is not about one connection (EMFILE, ENFILE, ENOBUFS…),
/// so the loop does not spin while the condition lasts.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// One connection's slot among [`ConnSettings::max_connections`], in every request's
/// extensions. The slot returns when the connection task and every clone of this handle are
/// gone: a handler that upgrades the connection keeps a clone for as long as the upgraded socket
/// is served.
#[derive(Debug, Clone)]
pub struct ConnSlot {
    _permit: Arc<tokio::sync::OwnedSemaphorePermit>,
}

/// How the accept loop treats each connection (the relay's from its configuration; the daemon's
/// LAN server uses the same loop with its own).
#[derive(Debug, Clone, Copy)]
pub struct ConnSettings {
    /// Which server this is, in log lines (`relay`, `LAN`).
    pub name: &'static str,
    /// Header-read timeout (hyper's: it also runs while a kept-alive connection waits for its
    /// next request).
    pub header_read: Duration,
    /// Keep-alive idle timeout: no request in flight for this long closes the connection.
    pub keep_alive: Duration,
    /// Most connections open at once (at least 1, at most `Semaphore::MAX_PERMITS`).
    pub max_connections: usize,
}

/// Accepts connections until `stop` resolves; then closes the listener (nothing listens any
/// more), asks every connection to shut down gracefully (an idle one closes at once, one with a
/// request in flight finishes that request and its answer first) and waits for them all.
/// Dropping the returned future aborts the connections still open. Every request carries the
/// peer's address as `axum::extract::ConnectInfo<SocketAddr>`.
pub async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    settings: ConnSettings,
    stop: impl Future<Output = ()>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(
        settings
            .max_connections
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
    ));
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let (tcp, remote, slot) = tokio::select! {
            biased;
            () = &mut stop => break,
            next = next_connection(&listener, &slots, settings) => next,
        };
        while let Some(done) = connections.try_join_next() {
            connection_ended(done, settings.name);
        }
        connections.spawn(serve_connection(
            tcp,
            remote,
            slot,
            app.clone(),
            settings,
            closing_rx.clone(),
        ));
    }
    drop(listener);
    closing_tx.send_replace(true);
    while let Some(done) = connections.join_next().await {
        connection_ended(done, settings.name);
    }
}

/// Reports a connection task that panicked (a handler panic ends only its connection).
fn connection_ended(done: Result<(), tokio::task::JoinError>, name: &str) {
    if let Err(e) = done {
        if e.is_panic() {
            tracing::error!("a {name} connection task panicked");
        }
    }
}

/// The next accepted connection with its slot (one of `max_connections` permits, held until
/// the connection closes). Waits for a free slot first; retries accept errors.
async fn next_connection(
    listener: &tokio::net::TcpListener,
    slots: &Arc<tokio::sync::Semaphore>,
    settings: ConnSettings,
) -> (
    tokio::net::TcpStream,
    std::net::SocketAddr,
    tokio::sync::OwnedSemaphorePermit,
) {
    let name = settings.name;
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                tracing::warn!(
                    max_connections = settings.max_connections,
                    "{name} connection limit reached: new connections wait until one closes"
                );
                match slots.clone().acquire_owned().await {
                    Ok(slot) => slot,
                    // The semaphore is never closed.
                    Err(_) => std::future::pending().await,
                }
            }
        };
        match listener.accept().await {
            Ok((tcp, remote)) => return (tcp, remote, slot),
            // About that one connection (gone before it was accepted): take the next.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) => {}
            Err(e) => {
                drop(slot);
                tracing::error!(error = %e, "{name} accept failed; retrying shortly");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// What one connection is doing, for its keep-alive timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Activity {
    /// Requests whose answer is not ready yet (HTTP/1: 0 or 1).
    in_flight: usize,
    /// Since when nothing is in flight (`None` while a request is).
    idle_since: Option<tokio::time::Instant>,
}

/// Marks one request in flight on its connection until dropped.
struct InFlight(Arc<tokio::sync::watch::Sender<Activity>>);

impl InFlight {
    fn begin(activity: Arc<tokio::sync::watch::Sender<Activity>>) -> Self {
        activity.send_modify(|a| {
            a.in_flight += 1;
            a.idle_since = None;
        });
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|a| {
            a.in_flight = a.in_flight.saturating_sub(1);
            if a.in_flight == 0 {
                a.idle_since = Some(tokio::time::Instant::now());
            }
        });
    }
}

/// The router as hyper calls it, counting the requests in flight on one connection.
struct Tracked {
    inner: hyper_util::service::TowerToHyperService<Router>,
    activity: Arc<tokio::sync::watch::Sender<Activity>>,
    remote: std::net::SocketAddr,
    slot: ConnSlot,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Tracked {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>;

    fn call(&self, mut req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(self.remote));
        req.extensions_mut().insert(self.slot.clone());
        let in_flight = InFlight::begin(self.activity.clone());
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answer = answer.await;
            drop(in_flight);
            answer
        })
    }
}

/// Resolves once the connection has had nothing in flight for `limit`.
async fn idle_for(activity: &mut tokio::sync::watch::Receiver<Activity>, limit: Duration) {
    loop {
        let since = activity.borrow_and_update().idle_since;
        let changed = match since {
            None => activity.changed().await,
            Some(since) => {
                tokio::select! {
                    biased;
                    changed = activity.changed() => changed,
                    () = tokio::time::sleep_until(since + limit) => {
                        // A request that started meanwhile (its head was parsed while the timer
                        // fired) keeps the connection.
                        if activity.borrow().idle_since == Some(since) {
                            return;
                        }
                        Ok(())
                    }
                }
            }
        };
        if changed.is_err() {
            // The connection is gone; its task ends without us.
            std::future::pending::<()>().await;
        }
    }
}

/// Resolves once the server asked its connections to close.
async fn closing(signal: &mut tokio::sync::watch::Receiver<bool>) {
    // An error means the accept loop is gone (its connections are being aborted): close too.
    let _ = signal.wait_for(|closing| *closing).await;
}

/// Serves one connection until it closes: HTTP/1.1 with keep-alive, the header-read timeout,
/// the keep-alive idle timeout and graceful shutdown once `closing_signal` says so. An upgrade
/// ends this task once hyper handed the socket over; the upgraded socket's server holds the
/// request's [`ConnSlot`] for as long as it serves it.
async fn serve_connection(
    tcp: tokio::net::TcpStream,
    remote: std::net::SocketAddr,
    slot: tokio::sync::OwnedSemaphorePermit,
    app: Router,
    settings: ConnSettings,
    mut closing_signal: tokio::sync::watch::Receiver<bool>,
) {
    let (activity_tx, mut activity) = tokio::sync::watch::channel(Activity {
        in_flight: 0,
        idle_since: Some(tokio::time::Instant::now()),
    });
    let service = Tracked {
        inner: hyper_util::service::TowerToHyperService::new(app),
        activity: Arc::new(activity_tx),
        remote,
        slot: ConnSlot {
            _permit: Arc::new(slot),
        },
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(settings.header_read)
        .keep_alive(true);
    let conn = http
        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
        .with_upgrades();
    let mut conn = std::pin::pin!(conn);
    let mut winding_down = false;
    loop {
        tokio::select! {
            // The connection first: bytes already there start a request before the idle timer
            // is looked at.
            biased;
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "{} connection ended with an error", settings.name);
                }
                return;
            }
            () = closing(&mut closing_signal), if !winding_down => {
                winding_down = true;
                conn.as_mut().graceful_shutdown();
            }
            () = idle_for(&mut activity, settings.keep_alive), if !winding_down => {
                winding_down = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}
