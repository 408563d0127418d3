//! RDMA endpoint and queue-pair addresses (relayed by the coordinator from other members):
//! a value that re-encodes and decodes to itself, or a typed error.
use cohort_transports::rdma::address::{EndpointAddress, RdmaAddress};

/// One input: the address text (not UTF-8: nothing to decode).
pub(crate) fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(a) = EndpointAddress::decode(text) {
        assert_eq!(EndpointAddress::decode(&a.encode()).unwrap(), a);
    }
    if let Ok(a) = RdmaAddress::decode(text) {
        assert_eq!(RdmaAddress::decode(&a.encode()).unwrap(), a);
    }
}
