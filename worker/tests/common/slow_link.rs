//! A loopback TCP proxy that holds every byte coming back from its upstream for a set time,
//! as a slow coordinator would: the requests pass at once, each answer arrives late, in order.
//! The delay can be changed while connections are open.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// A running proxy; it stops (and closes its connections) when dropped.
pub(crate) struct SlowLink {
    address: std::net::SocketAddr,
    delay_ms: Arc<AtomicU64>,
    _tasks: JoinSet<()>,
}

impl SlowLink {
    /// A proxy on a free loopback port in front of `upstream`, holding its answers `delay`.
    pub(crate) async fn start(upstream: std::net::SocketAddr, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let address = listener.local_addr().expect("address");
        let delay_ms = Arc::new(AtomicU64::new(delay.as_millis() as u64));
        let mut tasks = JoinSet::new();
        let delay = delay_ms.clone();
        tasks.spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                connections.spawn(relay(client, server, delay.clone()));
            }
        });
        Self { address, delay_ms, _tasks: tasks }
    }

    /// The proxy's address, for a client's endpoint.
    pub(crate) fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Holds the answers `delay` from now on.
    pub(crate) fn set_delay(&self, delay: Duration) {
        self.delay_ms.store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

/// Passes one connection's requests on at once and its answers after the delay, in order.
async fn relay(client: TcpStream, server: TcpStream, delay_ms: Arc<AtomicU64>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let (late, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let requests = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
        let _ = to_server.shutdown().await;
    };
    let answers_in = async move {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from_server.read(&mut buffer).await {
            let at = Instant::now() + Duration::from_millis(delay_ms.load(Ordering::Relaxed));
            if late.send((at, buffer[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let answers_out = async {
        while let Some((at, bytes)) = due.recv().await {
            // The link's latency itself (what the proxy is for), not a wait for another task.
            tokio::time::sleep_until(at).await;
            if to_client.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to_client.shutdown().await;
    };
    tokio::join!(requests, answers_in, answers_out);
}
