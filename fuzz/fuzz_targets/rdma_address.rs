//! RDMA endpoint and queue-pair addresses (relayed by the coordinator from other members):
//! a value that re-encodes and decodes to itself, or a typed error.
#![no_main]
use cohort_transports::rdma::address::{EndpointAddress, RdmaAddress};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(a) = EndpointAddress::decode(text) {
        assert_eq!(EndpointAddress::decode(&a.encode()).unwrap(), a);
    }
    if let Ok(a) = RdmaAddress::decode(text) {
        assert_eq!(RdmaAddress::decode(&a.encode()).unwrap(), a);
    }
});
