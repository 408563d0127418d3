//! The real gRPC stack over turmoil's simulated TCP: what a replica serves on
//! ([`incoming`]) and what a client dials with ([`Connector`]).

use hyper_util::rt::TokioIo;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tonic::transport::Uri;

/// The port every replica listens on.
pub(crate) const GRPC_PORT: u16 = 7100;

/// A simulated TCP connection, as tonic's server wants it.
pub(crate) struct SimStream(turmoil::net::TcpStream);

impl Connected for SimStream {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for SimStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The connections accepted on `listener`, as a stream tonic's server serves.
pub(crate) fn incoming(
    listener: turmoil::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<SimStream>> + Send + 'static {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _)| SimStream(stream));
        Some((accepted, listener))
    })
}

/// Dials `host:port` of an endpoint's URI on the simulated network.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Connector;

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<turmoil::net::TcpStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(GRPC_PORT);
            let stream = turmoil::net::TcpStream::connect((host.as_str(), port)).await?;
            Ok(TokioIo::new(stream))
        })
    }
}
