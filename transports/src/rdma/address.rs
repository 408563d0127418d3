//! Addresses of the RDMA transport and their stable text encodings (pure, no device).
//!
//! Two kinds of address exist:
//!
//! - [`EndpointAddress`] describes a worker's RDMA endpoint for its whole life: the port's LID
//!   and GID, its active MTU and the TCP *bootstrap* listener on which per-generation queue
//!   pairs are set up. It is what a worker publishes in its join request, as the `address`
//!   string of a `TransportAddress { transport: "rdma" }`, so it travels through the
//!   coordinator's generation record exactly as TCP addresses do.
//!   Encoding: `rdma-ep1;lid=<dec>;gid=<32 hex>;mtu=<bytes>;boot=<socket address>`.
//! - [`RdmaAddress`] describes one side of one queue pair of one generation: LID, GID, QP
//!   number, initial packet sequence number, MTU and the registered receive ring the peer may
//!   write into. It is exchanged over the authenticated bootstrap connection.
//!   Encoding: `rdma-qp1;lid=<dec>;gid=<32 hex>;qpn=<dec>;psn=<dec>;mtu=<bytes>;slot=<dec>;`
//!   `ring=<hex addr>:<hex rkey>:<dec len>`.
//!
//! Both decoders are strict: fields in that exact order, each once, nothing after the last,
//! every value range-checked, and the whole text at most [`MAX_ADDRESS_LEN`] bytes. Every
//! rejection says which field was wrong and why.

use std::fmt;
use std::net::SocketAddr;

/// Longest accepted encoded address, in bytes.
pub const MAX_ADDRESS_LEN: usize = 512;
/// Version tag opening an encoded [`EndpointAddress`].
pub const ENDPOINT_TAG: &str = "rdma-ep1";
/// Version tag opening an encoded [`RdmaAddress`].
pub const QP_TAG: &str = "rdma-qp1";
/// Queue pair numbers and packet sequence numbers are 24-bit quantities.
pub const MAX_24BIT: u32 = (1 << 24) - 1;
/// Smallest receive slot a peer may announce (room for the slot header plus one byte).
pub const MIN_SLOT_BYTES: u32 = 64;
/// Largest receive slot a peer may announce.
pub const MAX_SLOT_BYTES: u32 = 16 << 20;
/// Largest number of receive slots in one ring.
pub const MAX_SLOTS: u32 = 4096;

/// Why an encoded address was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// The text exceeds [`MAX_ADDRESS_LEN`].
    #[error("rdma address of {len} bytes exceeds the maximum of {max}")]
    TooLong {
        /// Length of the text.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The text does not open with the expected version tag.
    #[error("not an rdma address of this version: expected {expected:?}, got {got:?}")]
    BadVersion {
        /// The expected tag.
        expected: &'static str,
        /// What was found (cut to 32 bytes).
        got: String,
    },
    /// A field is missing or another field is in its place.
    #[error("rdma address: expected field {0:?}")]
    MissingField(&'static str),
    /// A field's value is malformed or out of range.
    #[error("rdma address: field {field:?} = {value:?}: {why}")]
    BadField {
        /// The field name.
        field: &'static str,
        /// The offending value (cut to 64 bytes).
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// Something follows the last field.
    #[error("rdma address: unexpected trailing text {0:?}")]
    Trailing(String),
}

/// Path MTU of an RDMA port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    M256,
    /// 512 bytes.
    M512,
    /// 1024 bytes.
    M1024,
    /// 2048 bytes.
    M2048,
    /// 4096 bytes.
    M4096,
}

impl Mtu {
    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Self::M256 => 256,
            Self::M512 => 512,
            Self::M1024 => 1024,
            Self::M2048 => 2048,
            Self::M4096 => 4096,
        }
    }

    /// The MTU of `bytes`, if it is one of the five IB MTUs.
    pub fn from_bytes(bytes: u32) -> Option<Self> {
        Some(match bytes {
            256 => Self::M256,
            512 => Self::M512,
            1024 => Self::M1024,
            2048 => Self::M2048,
            4096 => Self::M4096,
            _ => return None,
        })
    }

    /// The verbs enumeration value (`IBV_MTU_256` = 1 ... `IBV_MTU_4096` = 5).
    pub fn to_verbs(self) -> u32 {
        match self {
            Self::M256 => 1,
            Self::M512 => 2,
            Self::M1024 => 3,
            Self::M2048 => 4,
            Self::M4096 => 5,
        }
    }

    /// The MTU of a verbs enumeration value.
    pub fn from_verbs(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::M256,
            2 => Self::M512,
            3 => Self::M1024,
            4 => Self::M2048,
            5 => Self::M4096,
            _ => return None,
        })
    }
}

/// A registered memory region a peer may RDMA-write into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvRegion {
    /// Virtual address of the region in the owner's address space.
    pub addr: u64,
    /// Remote key of the region's memory registration.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

/// A worker's long-lived RDMA endpoint, as published through the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointAddress {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// Global identifier at the configured GID index.
    pub gid: [u8; 16],
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// TCP listener on which queue pairs are set up for each generation.
    pub bootstrap: SocketAddr,
}

/// One side of one queue pair, exchanged during set-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaAddress {
    /// Local identifier of the port (0 on RoCE).
    pub lid: u16,
    /// Global identifier at the configured GID index.
    pub gid: [u8; 16],
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// Size of one receive slot in bytes.
    pub slot_bytes: u32,
    /// The receive ring: `ring.len / slot_bytes` slots of `slot_bytes` bytes.
    pub ring: RecvRegion,
}

impl RdmaAddress {
    /// Number of slots in the ring.
    pub fn slots(&self) -> u32 {
        self.ring.len / self.slot_bytes
    }
}

fn hex(bytes: &[u8]) -> String {
    use fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        // Writing into a String cannot fail.
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn bad(field: &'static str, value: &str, why: impl Into<String>) -> AddressError {
    AddressError::BadField { field, value: cut(value, 64), why: why.into() }
}

/// Walks the `;`-separated fields of an encoded address in order.
struct Fields<'a> {
    parts: std::str::Split<'a, char>,
}

impl<'a> Fields<'a> {
    fn open(text: &'a str, tag: &'static str) -> Result<Self, AddressError> {
        if text.len() > MAX_ADDRESS_LEN {
            return Err(AddressError::TooLong { len: text.len(), max: MAX_ADDRESS_LEN });
        }
        let mut parts = text.split(';');
        let first = parts.next().unwrap_or("");
        if first != tag {
            return Err(AddressError::BadVersion { expected: tag, got: cut(first, 32) });
        }
        Ok(Self { parts })
    }

    fn next(&mut self, key: &'static str) -> Result<&'a str, AddressError> {
        let part = self.parts.next().ok_or(AddressError::MissingField(key))?;
        match part.split_once('=') {
            Some((k, v)) if k == key => Ok(v),
            _ => Err(AddressError::MissingField(key)),
        }
    }

    fn finish(mut self) -> Result<(), AddressError> {
        match self.parts.next() {
            None => Ok(()),
            Some(rest) => Err(AddressError::Trailing(cut(rest, 32))),
        }
    }
}

fn dec<T: std::str::FromStr>(field: &'static str, v: &str) -> Result<T, AddressError> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) || v.len() > 20 {
        return Err(bad(field, v, "not a decimal number"));
    }
    v.parse().map_err(|_| bad(field, v, "out of range"))
}

fn hex_u64(field: &'static str, v: &str, max_digits: usize) -> Result<u64, AddressError> {
    if v.is_empty() || v.len() > max_digits || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad(field, v, format!("not a hexadecimal number of 1..={max_digits} digits")));
    }
    u64::from_str_radix(v, 16).map_err(|_| bad(field, v, "out of range"))
}

fn parse_gid(v: &str) -> Result<[u8; 16], AddressError> {
    if v.len() != 32 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad("gid", v, "not 32 hexadecimal digits"));
    }
    let mut gid = [0u8; 16];
    for (i, g) in gid.iter_mut().enumerate() {
        *g = u8::from_str_radix(&v[2 * i..2 * i + 2], 16).map_err(|_| bad("gid", v, "bad hex digit"))?;
    }
    Ok(gid)
}

fn parse_mtu(v: &str) -> Result<Mtu, AddressError> {
    let n: u32 = dec("mtu", v)?;
    Mtu::from_bytes(n).ok_or_else(|| bad("mtu", v, "not one of 256, 512, 1024, 2048, 4096"))
}

fn parse_24(field: &'static str, v: &str) -> Result<u32, AddressError> {
    let n: u32 = dec(field, v)?;
    if n > MAX_24BIT {
        return Err(bad(field, v, "exceeds 24 bits"));
    }
    Ok(n)
}

impl EndpointAddress {
    /// The stable text encoding (see the module docs).
    pub fn encode(&self) -> String {
        format!(
            "{ENDPOINT_TAG};lid={};gid={};mtu={};boot={}",
            self.lid,
            hex(&self.gid),
            self.mtu.bytes(),
            self.bootstrap
        )
    }

    /// Decodes and validates an encoded endpoint address.
    pub fn decode(text: &str) -> Result<Self, AddressError> {
        let mut f = Fields::open(text, ENDPOINT_TAG)?;
        let lid = dec("lid", f.next("lid")?)?;
        let gid = parse_gid(f.next("gid")?)?;
        let mtu = parse_mtu(f.next("mtu")?)?;
        let boot = f.next("boot")?;
        let bootstrap: SocketAddr = boot.parse().map_err(|_| bad("boot", boot, "not an IP socket address"))?;
        if bootstrap.port() == 0 {
            return Err(bad("boot", boot, "port 0"));
        }
        f.finish()?;
        Ok(Self { lid, gid, mtu, bootstrap })
    }
}

impl RdmaAddress {
    /// The stable text encoding (see the module docs).
    pub fn encode(&self) -> String {
        format!(
            "{QP_TAG};lid={};gid={};qpn={};psn={};mtu={};slot={};ring={:x}:{:x}:{}",
            self.lid,
            hex(&self.gid),
            self.qpn,
            self.psn,
            self.mtu.bytes(),
            self.slot_bytes,
            self.ring.addr,
            self.ring.rkey,
            self.ring.len
        )
    }

    /// Decodes and validates an encoded queue-pair address: 24-bit QPN and PSN, a slot size
    /// in [`MIN_SLOT_BYTES`]..=[`MAX_SLOT_BYTES`], and a ring of 1..=[`MAX_SLOTS`] whole
    /// slots at a non-null address.
    pub fn decode(text: &str) -> Result<Self, AddressError> {
        let mut f = Fields::open(text, QP_TAG)?;
        let lid = dec("lid", f.next("lid")?)?;
        let gid = parse_gid(f.next("gid")?)?;
        let qpn = parse_24("qpn", f.next("qpn")?)?;
        let psn = parse_24("psn", f.next("psn")?)?;
        let mtu = parse_mtu(f.next("mtu")?)?;
        let slot_text = f.next("slot")?;
        let slot_bytes: u32 = dec("slot", slot_text)?;
        if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) {
            return Err(bad("slot", slot_text, format!("outside {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES}")));
        }
        let ring_text = f.next("ring")?;
        let mut it = ring_text.split(':');
        let (Some(a), Some(k), Some(l), None) = (it.next(), it.next(), it.next(), it.next()) else {
            return Err(bad("ring", ring_text, "expected <hex addr>:<hex rkey>:<len>"));
        };
        let addr = hex_u64("ring", a, 16)?;
        // At most 8 hex digits, so the value fits in 32 bits.
        let rkey = hex_u64("ring", k, 8)? as u32;
        let len: u32 = dec("ring", l)?;
        if addr == 0 {
            return Err(bad("ring", ring_text, "null address"));
        }
        if len == 0 || len % slot_bytes != 0 {
            return Err(bad(
                "ring",
                ring_text,
                format!("length is not a positive multiple of the slot size {slot_bytes}"),
            ));
        }
        if len / slot_bytes > MAX_SLOTS {
            return Err(bad("ring", ring_text, format!("more than {MAX_SLOTS} slots")));
        }
        if addr.checked_add(u64::from(len)).is_none() {
            return Err(bad("ring", ring_text, "region wraps the address space"));
        }
        f.finish()?;
        Ok(Self { lid, gid, qpn, psn, mtu, slot_bytes, ring: RecvRegion { addr, rkey, len } })
    }
}

impl fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

impl fmt::Display for RdmaAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep() -> EndpointAddress {
        EndpointAddress {
            lid: 17,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x1a, 0x4b, 0xff, 0xfe, 0x00, 0x12, 0x34],
            mtu: Mtu::M4096,
            bootstrap: "127.0.0.1:45001".parse().unwrap(),
        }
    }

    fn qp() -> RdmaAddress {
        RdmaAddress {
            lid: 0,
            gid: [0xab; 16],
            qpn: 0x00ab_cdef,
            psn: 12345,
            mtu: Mtu::M1024,
            slot_bytes: 65536,
            ring: RecvRegion { addr: 0x7f12_3456_7000, rkey: 0xdead_beef, len: 65536 * 16 },
        }
    }

    #[test]
    fn endpoint_round_trip_and_stable_text() {
        let e = ep();
        let s = e.encode();
        assert_eq!(s, "rdma-ep1;lid=17;gid=fe80000000000000021a4bfffe001234;mtu=4096;boot=127.0.0.1:45001");
        assert_eq!(EndpointAddress::decode(&s), Ok(e.clone()));
        let mut v6 = e;
        v6.bootstrap = "[::1]:7".parse().unwrap();
        assert_eq!(EndpointAddress::decode(&v6.encode()), Ok(v6));
    }

    #[test]
    fn qp_round_trip_and_stable_text() {
        let q = qp();
        let s = q.encode();
        assert_eq!(
            s,
            "rdma-qp1;lid=0;gid=abababababababababababababababab;qpn=11259375;psn=12345;mtu=1024;slot=65536;ring=7f1234567000:deadbeef:1048576"
        );
        let d = RdmaAddress::decode(&s).unwrap();
        assert_eq!(d, q);
        assert_eq!(d.slots(), 16);
        assert!(s.len() <= MAX_ADDRESS_LEN);
    }

    #[test]
    fn every_mtu_round_trips() {
        for b in [256, 512, 1024, 2048, 4096] {
            let m = Mtu::from_bytes(b).unwrap();
            assert_eq!(m.bytes(), b);
            assert_eq!(Mtu::from_verbs(m.to_verbs()), Some(m));
        }
        assert_eq!(Mtu::from_bytes(1500), None);
        assert_eq!(Mtu::from_verbs(0), None);
        assert_eq!(Mtu::from_verbs(6), None);
    }

    #[test]
    fn rejects_garbage_with_clear_errors() {
        let good = qp().encode();
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "expected \"rdma-qp1\""),
            ("127.0.0.1:4000".into(), "not an rdma address"),
            (ep().encode(), "not an rdma address"),
            (good.replace("qpn=11259375", "qpn=16777216"), "exceeds 24 bits"),
            (good.replace("psn=12345", "psn=-1"), "not a decimal number"),
            (good.replace("mtu=1024", "mtu=1500"), "not one of"),
            (good.replace("gid=abab", "gid=zzab"), "not 32 hexadecimal digits"),
            (good.replace("gid=abab", "gid=ab"), "not 32 hexadecimal digits"),
            (good.replace("slot=65536", "slot=8"), "outside"),
            (good.replace(":1048576", ":1048577"), "positive multiple"),
            (good.replace(":1048576", ":0"), "positive multiple"),
            (good.replace("7f1234567000:", "0:"), "null address"),
            (good.replace("slot=65536", "slot=64"), "more than 4096 slots"),
            (good.replace("deadbeef", "1deadbeef"), "hexadecimal number of 1..=8"),
            (good.replace(":deadbeef:1048576", ":deadbeef"), "expected <hex addr>"),
            (good.replace("lid=0;", ""), "expected field \"lid\""),
            (good.replace("lid=0;gid", "gid=1;lid"), "expected field \"lid\""),
            (format!("{good};x=1"), "trailing"),
            (good.replace("lid=0", "lid=65536"), "out of range"),
            (format!("{good}{}", "0".repeat(600)), "exceeds the maximum"),
        ];
        for (text, want) in cases {
            let err = RdmaAddress::decode(&text).expect_err(&text).to_string();
            assert!(err.contains(want), "{text:?}: error {err:?} does not contain {want:?}");
        }
        let ep_good = ep().encode();
        for (text, want) in [
            (ep_good.replace("boot=127.0.0.1:45001", "boot=localhost:45001"), "not an IP socket address"),
            (ep_good.replace(":45001", ":0"), "port 0"),
            (ep_good.replace("rdma-ep1", "rdma-ep2"), "not an rdma address"),
        ] {
            let err = EndpointAddress::decode(&text).expect_err(&text).to_string();
            assert!(err.contains(want), "{text:?}: error {err:?} does not contain {want:?}");
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let good = qp().encode().into_bytes();
        for _ in 0..2000 {
            let mut b = good.clone();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..b.len());
                b[i] = rng.random();
            }
            if let Ok(s) = std::str::from_utf8(&b) {
                if let Ok(a) = RdmaAddress::decode(s) {
                    // Whatever decodes re-encodes to itself (the encoding is canonical).
                    assert_eq!(RdmaAddress::decode(&a.encode()), Ok(a));
                }
            }
        }
    }
}
