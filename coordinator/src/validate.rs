//! Request validation: every field a client sends is checked here before any state is read
//! or changed. A failed check is an `INVALID_ARGUMENT` status naming the field.

use cohort_proto::v1::TransportAddress;
use tonic::Status;

/// Longest host name accepted in a join.
pub const MAX_HOST_LEN: usize = 255;
/// Most data-plane addresses per member.
pub const MAX_ADDRESSES: usize = 8;
/// Longest encoded address (rdma endpoints are longer than tcp ones).
pub const MAX_ADDRESS_LEN: usize = 512;
/// Most capabilities per member.
pub const MAX_CAPABILITIES: usize = 32;
/// Longest capability string.
pub const MAX_CAPABILITY_LEN: usize = 128;
/// Longest failure reason.
pub const MAX_REASON_LEN: usize = 4096;
/// Longest activity string in a heartbeat.
pub const MAX_ACTIVITY_LEN: usize = 256;
/// Largest state digest in a commit.
pub const MAX_DIGEST_LEN: usize = 64;

/// Checks a job or worker id: 1..=128 characters of `[A-Za-z0-9._-]`, the rule every part
/// of cohort applies ([`cohort_proto::ids::check_id`]).
pub fn id(field: &'static str, value: &str) -> Result<(), Status> {
    cohort_proto::ids::check_id(field, value).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// Checks a free-text field's length (and that it has no control characters other than
/// tab and newline).
pub fn text(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(Status::invalid_argument(format!("{field} is {} bytes long (at most {max})", value.len())));
    }
    if value.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(Status::invalid_argument(format!("{field} contains control characters")));
    }
    Ok(())
}

/// Checks a key of the job's key-value store (`StoreOp`): 1..=[`crate::kv::MAX_KEY_LEN`]
/// bytes, no NUL.
pub fn store_key(field: &str, key: &str) -> Result<(), Status> {
    if key.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is empty (a store key needs at least one byte)")));
    }
    if key.len() > crate::kv::MAX_KEY_LEN {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes long (a store key has at most {})",
            key.len(),
            crate::kv::MAX_KEY_LEN
        )));
    }
    if key.contains('\0') {
        return Err(Status::invalid_argument(format!("{field} contains a NUL byte")));
    }
    Ok(())
}

/// Checks a value for the job's key-value store: at most [`crate::kv::MAX_VALUE_LEN`] bytes.
pub fn store_value(field: &str, value: &[u8]) -> Result<(), Status> {
    if value.len() > crate::kv::MAX_VALUE_LEN {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes (a store value has at most {} bytes, 1 MiB)",
            value.len(),
            crate::kv::MAX_VALUE_LEN
        )));
    }
    Ok(())
}

/// Checks a store scope: empty, or an id (`[A-Za-z0-9._-]`, at most 128 characters).
pub fn store_scope(scope: &str) -> Result<(), Status> {
    if scope.is_empty() {
        return Ok(());
    }
    cohort_proto::ids::check_id("scope", scope).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// Checks an incarnation number (they are never 0).
pub fn incarnation(value: u64) -> Result<(), Status> {
    if value == 0 || value > i64::MAX as u64 {
        return Err(Status::invalid_argument(
            "incarnation is not one the coordinator hands out (use JoinResponse.incarnation)",
        ));
    }
    Ok(())
}

/// Checks the client's protocol version.
pub fn protocol_version(value: u32) -> Result<(), Status> {
    if value != cohort_proto::PROTOCOL_VERSION {
        return Err(Status::invalid_argument(format!(
            "protocol_version {value} is not supported (this coordinator speaks {})",
            cohort_proto::PROTOCOL_VERSION
        )));
    }
    Ok(())
}

/// Checks a `tcp` address: `HOST:PORT` with a non-zero port, HOST an IPv4 literal,
/// `[IPv6]` or a DNS name.
fn tcp_address(field: &str, value: &str) -> Result<(), Status> {
    let bad = |why: &str| Status::invalid_argument(format!("{field} {value:?} is not a tcp HOST:PORT: {why}"));
    if let Ok(sa) = value.parse::<std::net::SocketAddr>() {
        if sa.port() == 0 {
            return Err(bad("port 0"));
        }
        if sa.ip().is_unspecified() {
            return Err(bad("unspecified address (advertise a reachable one)"));
        }
        return Ok(());
    }
    let (host, port) = value.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("port is not a number in 1..=65535"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    if host.is_empty() || host.len() > 253 {
        return Err(bad("empty or overlong host"));
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !host.split('.').all(label_ok) {
        return Err(bad("host is neither an IP address nor a DNS name"));
    }
    Ok(())
}

/// Checks the data-plane addresses of a join.
pub fn addresses(addresses: &[TransportAddress]) -> Result<(), Status> {
    if addresses.is_empty() {
        return Err(Status::invalid_argument("addresses is empty (give at least one data-plane address)"));
    }
    if addresses.len() > MAX_ADDRESSES {
        return Err(Status::invalid_argument(format!(
            "addresses has {} entries (at most {MAX_ADDRESSES})",
            addresses.len()
        )));
    }
    for (i, a) in addresses.iter().enumerate() {
        let field = format!("addresses[{i}].address");
        match a.transport.as_str() {
            "tcp" => tcp_address(&field, &a.address)?,
            "rdma" | "shm" => {
                if a.address.is_empty() {
                    return Err(Status::invalid_argument(format!("{field} is empty")));
                }
                if a.address.len() > MAX_ADDRESS_LEN
                    || !a.address.is_ascii()
                    || a.address.chars().any(|c| c.is_ascii_control())
                {
                    return Err(Status::invalid_argument(format!(
                        "{field} must be printable ASCII of at most {MAX_ADDRESS_LEN} bytes"
                    )));
                }
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "addresses[{i}].transport {other:?} is unknown (tcp, shm or rdma)"
                )))
            }
        }
        if addresses[..i].iter().any(|b| b.transport == a.transport) {
            return Err(Status::invalid_argument(format!("addresses[{i}]: a second {} address", a.transport)));
        }
    }
    Ok(())
}

/// Checks the capabilities of a join.
pub fn capabilities(capabilities: &[String]) -> Result<(), Status> {
    if capabilities.len() > MAX_CAPABILITIES {
        return Err(Status::invalid_argument(format!(
            "capabilities has {} entries (at most {MAX_CAPABILITIES})",
            capabilities.len()
        )));
    }
    for (i, c) in capabilities.iter().enumerate() {
        if c.is_empty() {
            return Err(Status::invalid_argument(format!("capabilities[{i}] is empty")));
        }
        text(&format!("capabilities[{i}]"), c, MAX_CAPABILITY_LEN)?;
    }
    Ok(())
}

/// Checks that a generation number a client names exists (is not in the future).
pub fn generation(field: &str, value: u64, current: u64) -> Result<(), Status> {
    if value > current {
        return Err(Status::invalid_argument(format!(
            "{field} {value} is in the future (the job's newest generation is {current})"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(a: &str) -> Vec<TransportAddress> {
        vec![TransportAddress { transport: "tcp".into(), address: a.into() }]
    }

    #[test]
    fn ids() {
        assert!(id("job", "job-1.a_b").is_ok());
        assert!(id("job", &"x".repeat(128)).is_ok());
        for bad in ["", "a/b", "a b", "é", &"x".repeat(129), "..", "a\n"] {
            let e = id("job", bad).expect_err(bad);
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with("job"), "{}", e.message());
        }
    }

    #[test]
    fn tcp_addresses() {
        for ok in ["127.0.0.1:5000", "[::1]:80", "worker-3.svc.cluster.local:29500", "localhost:1"] {
            assert!(addresses(&tcp(ok)).is_ok(), "{ok}");
        }
        for bad in ["127.0.0.1:0", "127.0.0.1", "host:", ":80", "0.0.0.0:80", "a_b:80", "host:70000", "[::1]:0", "-x:5"]
        {
            assert!(addresses(&tcp(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn address_lists() {
        assert!(addresses(&[]).is_err());
        let many: Vec<_> =
            (0..9).map(|i| TransportAddress { transport: "tcp".into(), address: format!("h:{}", i + 1) }).collect();
        assert!(addresses(&many).is_err());
        let unknown = vec![TransportAddress { transport: "udp".into(), address: "h:1".into() }];
        assert!(addresses(&unknown).is_err());
        let rdma = vec![
            TransportAddress { transport: "tcp".into(), address: "h:1".into() },
            TransportAddress { transport: "rdma".into(), address: "lid=1,qpn=2".into() },
        ];
        assert!(addresses(&rdma).is_ok());
        let empty_rdma = vec![TransportAddress { transport: "rdma".into(), address: String::new() }];
        assert!(addresses(&empty_rdma).is_err());
        let shm = vec![
            TransportAddress { transport: "tcp".into(), address: "h:1".into() },
            TransportAddress { transport: "shm".into(), address: "shm1;host=boot=x:net=1:ipc=2;nonce=00ff00ff".into() },
        ];
        assert!(addresses(&shm).is_ok());
        let bad_shm = vec![TransportAddress { transport: "shm".into(), address: "a\nb".into() }];
        assert!(addresses(&bad_shm).is_err());
    }

    #[test]
    fn limits() {
        assert!(text("reason", &"r".repeat(4096), MAX_REASON_LEN).is_ok());
        assert!(text("reason", &"r".repeat(4097), MAX_REASON_LEN).is_err());
        assert!(capabilities(&vec!["c".to_string(); 33]).is_err());
        assert!(capabilities(&["".to_string()]).is_err());
        assert!(generation("generation", 3, 2).is_err());
        assert!(generation("generation", 2, 2).is_ok());
        assert!(protocol_version(2).is_err());
        assert!(protocol_version(1).is_ok());
        assert!(incarnation(0).is_err());
    }
}
