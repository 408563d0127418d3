//! The etcd client's HTTP/2 connections, set up for a client that gives up on requests.
//!
//! Every etcd request runs under a deadline; one that outlives it is dropped, and HTTP/2 then
//! resets its stream (`RST_STREAM`). etcd's answer may still arrive afterwards. h2 ignores
//! frames of a stream it remembers resetting, but it remembers only a few (50 by default,
//! for 30 s); a frame of one it forgot is a protocol error it detects itself, and h2 counts
//! those per connection, over the connection's life, never forgetting one: at the 1,024th it
//! closes the connection (`GOAWAY`, `ENHANCE_YOUR_CALM`, "too_many_internal_resets"), and every
//! request in flight on it fails (`ResourceExhausted`). A job's end, thousands of leaves at
//! once on 2 busy cores, got there in seconds: the connection died, the leader lost its lease,
//! the replicas' watches failed, and reconnections died the same way while the storm lasted.
//! The limit guards a client against a misbehaving server; etcd is the coordinator's own
//! store, so this client remembers many more reset streams (late answers are then ignored, as
//! they should be) and has no limit on such errors.

use etcd_client::{BalancedChannelBuilder, Channel};
use tokio::sync::mpsc;
use tonic::codegen::http::Uri;
use tonic::transport::channel::Change;
use tonic::transport::Endpoint;

/// Reset streams each connection remembers (h2's default is 50): enough for every request a
/// replica has in flight to time out at once.
pub(super) const REMEMBERED_RESETS: usize = 16_384;

/// How long a reset stream is remembered: past every deadline of a request, so that its late
/// answer is still recognised.
pub(super) const REMEMBER_RESETS_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Builds the etcd client's balanced channel, with every endpoint tuned ([`tune`]) on its way
/// in.
pub(super) struct TunedChannel;

impl BalancedChannelBuilder for TunedChannel {
    type Error = tonic::transport::Error;

    fn balanced_channel(self, buffer: usize) -> Result<(Channel, mpsc::Sender<Change<Uri, Endpoint>>), Self::Error> {
        let (channel, endpoints) = tonic::transport::Channel::balance_channel(buffer);
        let (tx, mut rx) = mpsc::channel::<Change<Uri, Endpoint>>(buffer);
        // The client sends its endpoints through `tx` (at connection, and on a member list
        // update); each goes on, tuned, to the channel. The task ends with the client.
        tokio::spawn(async move {
            while let Some(change) = rx.recv().await {
                let change = match change {
                    Change::Insert(uri, endpoint) => Change::Insert(uri, tune(endpoint)),
                    other => other,
                };
                if endpoints.send(change).await.is_err() {
                    return;
                }
            }
        });
        Ok((Channel::Tonic(channel), tx))
    }
}

/// One etcd endpoint as this client connects to it: see the module's documentation.
pub(super) fn tune(endpoint: Endpoint) -> Endpoint {
    endpoint
        .http2_max_concurrent_reset_streams(REMEMBERED_RESETS)
        .http2_reset_stream_duration(REMEMBER_RESETS_FOR)
        .http2_max_local_error_reset_streams(None)
}
