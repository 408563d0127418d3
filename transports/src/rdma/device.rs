//! Opening an RDMA device: selection, port, GID, protection domain.
//!
//! A device is chosen by name, or else the first device with an `ACTIVE` port; the port is
//! the configured one or the first active one; the GID index is the configured one, or on
//! RoCE (Ethernet link layer) the first IPv4-mapped GID (RoCE v2 over IPv4) and then the
//! first non-zero one, and on InfiniBand index 0. Every failure names what is missing.

use super::address::Mtu;
use crate::TransportError;
use rdma_sys as ffi;
use std::ffi::CStr;
use std::ptr::NonNull;

/// Link layer value of an Ethernet (RoCE) port (`IBV_LINK_LAYER_ETHERNET`).
const LINK_LAYER_ETHERNET: u8 = 2;
/// GID table entries scanned when choosing a RoCE GID.
const GID_SCAN: i32 = 16;

/// Which device, port and GID to use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name (`mlx5_0`); `None` picks the first device with an active port.
    pub name: Option<String>,
    /// Port number (from 1); `None` picks the first active port.
    pub port: Option<u8>,
    /// GID index; `None` chooses as the module docs say.
    pub gid_index: Option<u8>,
}

/// Names of the RDMA devices present, or an error saying why there are none.
pub fn device_names() -> Result<Vec<String>, TransportError> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(device_name).collect())
}

/// The device list returned by `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self, TransportError> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array (if non-null) is owned by
        // us until ibv_free_device_list, which Drop calls.
        let raw = unsafe { ffi::ibv_get_device_list(&mut n) };
        let Some(list) = NonNull::new(raw) else {
            let e = std::io::Error::last_os_error();
            return Err(TransportError::Io(format!(
                "no RDMA device found (ibv_get_device_list failed: {e}; is the kernel's RDMA support loaded?)"
            )));
        };
        let this = Self { list, len: usize::try_from(n).unwrap_or(0) };
        if this.len == 0 {
            return Err(TransportError::Io("no RDMA device found (ibv_get_device_list returned 0 devices)".into()));
        }
        Ok(this)
    }

    fn iter(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        // SAFETY: the array holds `len` valid device pointers while the list is alive.
        (0..self.len).map(move |i| unsafe { *self.list.as_ptr().add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) }
    }
}

fn device_name(dev: *mut ffi::ibv_device) -> String {
    // SAFETY: `dev` is a valid device of a live list; the name is a NUL-terminated string
    // owned by the device.
    let p = unsafe { ffi::ibv_get_device_name(dev) };
    if p.is_null() {
        return "<unnamed>".into();
    }
    // SAFETY: non-null, NUL-terminated, valid while the list is alive (copied out here).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An open device context with its protection domain and chosen port.
///
/// Freed in order on drop: protection domain, then context. Everything created from it
/// (memory regions, completion queues, queue pairs) holds an `Arc<Device>`, so it outlives
/// them.
pub struct Device {
    ctx: NonNull<ffi::ibv_context>,
    pd: NonNull<ffi::ibv_pd>,
    name: String,
    port: u8,
    gid_index: u8,
    lid: u16,
    gid: [u8; 16],
    mtu: Mtu,
    ethernet: bool,
    max_cqe: i32,
    max_qp_wr: i32,
}

// SAFETY: libibverbs objects may be used from any thread; verbs calls on a context, PD, CQ or
// QP are internally synchronised by the library and drivers. The raw pointers are never
// exposed mutably to safe code.
unsafe impl Send for Device {}
// SAFETY: see Send.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("gid_index", &self.gid_index)
            .field("lid", &self.lid)
            .field("mtu", &self.mtu)
            .field("ethernet", &self.ethernet)
            .finish()
    }
}

/// A closed-on-drop context, used while opening so that early returns free it.
struct Ctx(NonNull<ffi::ibv_context>);

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: the context came from ibv_open_device and nothing else refers to it.
        unsafe { ffi::ibv_close_device(self.0.as_ptr()) };
    }
}

fn query_port(ctx: *mut ffi::ibv_context, port: u8) -> Result<ffi::ibv_port_attr, TransportError> {
    // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
    let mut attr: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is an open context and attr a valid out-pointer of the full struct size.
    let rc = unsafe { ffi::___ibv_query_port(ctx, port, &mut attr) };
    if rc != 0 {
        return Err(TransportError::Io(format!(
            "ibv_query_port(port {port}) failed: {}",
            std::io::Error::from_raw_os_error(rc.abs())
        )));
    }
    Ok(attr)
}

fn query_gid(ctx: *mut ffi::ibv_context, port: u8, index: i32) -> Option<[u8; 16]> {
    // SAFETY: ibv_gid is a union of plain bytes; all-zero is valid.
    let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: valid context and out-pointer.
    let rc = unsafe { ffi::ibv_query_gid(ctx, port, index, &mut gid) };
    // SAFETY: every bit pattern of the union is valid as raw bytes.
    let raw = unsafe { gid.raw };
    (rc == 0).then_some(raw)
}

impl Device {
    /// Opens the device `config` selects; fails with [`TransportError::Io`] naming what is
    /// missing (no devices, no such device, no active port, bad GID index).
    pub fn open(config: &DeviceConfig) -> Result<Self, TransportError> {
        let list = DeviceList::get()?;
        let mut tried = Vec::new();
        for dev in list.iter() {
            let name = device_name(dev);
            if config.name.as_ref().is_some_and(|want| *want != name) {
                tried.push(name);
                continue;
            }
            match Self::open_one(dev, &name, config) {
                Ok(d) => return Ok(d),
                Err(e) if config.name.is_some() => return Err(e),
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(TransportError::Io(match &config.name {
            Some(want) => format!("RDMA device {want:?} not found (devices present: {})", tried.join(", ")),
            None => format!("no RDMA device with an active port ({})", tried.join("; ")),
        }))
    }

    fn open_one(dev: *mut ffi::ibv_device, name: &str, config: &DeviceConfig) -> Result<Self, TransportError> {
        // SAFETY: `dev` is a valid device of a live list.
        let ctx = NonNull::new(unsafe { ffi::ibv_open_device(dev) }).ok_or_else(|| {
            TransportError::Io(format!("ibv_open_device({name}) failed: {}", std::io::Error::last_os_error()))
        })?;
        let ctx = Ctx(ctx);
        // SAFETY: plain old data, zero is valid.
        let mut dattr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context and valid out-pointer.
        let rc = unsafe { ffi::ibv_query_device(ctx.0.as_ptr(), &mut dattr) };
        if rc != 0 {
            return Err(TransportError::Io(format!(
                "ibv_query_device({name}) failed: {}",
                std::io::Error::from_raw_os_error(rc.abs())
            )));
        }
        let ports: Vec<u8> = match config.port {
            Some(p) => vec![p],
            None => (1..=dattr.phys_port_cnt).collect(),
        };
        let mut chosen = None;
        for p in ports {
            let attr = query_port(ctx.0.as_ptr(), p)?;
            if attr.state == ffi::ibv_port_state::IBV_PORT_ACTIVE {
                chosen = Some((p, attr));
                break;
            }
        }
        let Some((port, pattr)) = chosen else {
            return Err(TransportError::Io(match config.port {
                Some(p) => format!("port {p} of {name} is not ACTIVE"),
                None => format!("{name} has no ACTIVE port"),
            }));
        };
        let ethernet = pattr.link_layer == LINK_LAYER_ETHERNET;
        let gid_index = match config.gid_index {
            Some(i) => i,
            None if ethernet => {
                let table = i32::min(pattr.gid_tbl_len, GID_SCAN);
                let gids: Vec<(i32, [u8; 16])> =
                    (0..table).filter_map(|i| query_gid(ctx.0.as_ptr(), port, i).map(|g| (i, g))).collect();
                let v4 = gids.iter().find(|(_, g)| g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff);
                let any = gids.iter().find(|(_, g)| g.iter().any(|b| *b != 0));
                let (i, _) =
                    v4.or(any).ok_or_else(|| TransportError::Io(format!("{name} port {port}: no usable RoCE GID")))?;
                // i < GID_SCAN = 16, fits in u8.
                *i as u8
            }
            None => 0,
        };
        let gid = query_gid(ctx.0.as_ptr(), port, i32::from(gid_index))
            .ok_or_else(|| TransportError::Io(format!("{name} port {port}: GID index {gid_index} cannot be read")))?;
        if ethernet && gid.iter().all(|b| *b == 0) {
            return Err(TransportError::Io(format!(
                "{name} port {port}: GID index {gid_index} is empty (RoCE needs a GID)"
            )));
        }
        let mtu = Mtu::from_verbs(pattr.active_mtu).ok_or_else(|| {
            TransportError::Io(format!("{name} port {port}: unknown active MTU value {}", pattr.active_mtu))
        })?;
        // SAFETY: open context.
        let pd = NonNull::new(unsafe { ffi::ibv_alloc_pd(ctx.0.as_ptr()) }).ok_or_else(|| {
            TransportError::Io(format!("ibv_alloc_pd({name}) failed: {}", std::io::Error::last_os_error()))
        })?;
        let ctx_ptr = ctx.0;
        std::mem::forget(ctx);
        tracing::info!(
            device = name,
            port,
            gid_index,
            lid = pattr.lid,
            mtu = mtu.bytes(),
            ethernet,
            "opened RDMA device"
        );
        Ok(Self {
            ctx: ctx_ptr,
            pd,
            name: name.to_owned(),
            port,
            gid_index,
            lid: pattr.lid,
            gid,
            mtu,
            ethernet,
            max_cqe: dattr.max_cqe,
            max_qp_wr: dattr.max_qp_wr,
        })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Port in use.
    pub fn port(&self) -> u8 {
        self.port
    }
    /// GID index in use.
    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }
    /// The port's LID (0 on RoCE).
    pub fn lid(&self) -> u16 {
        self.lid
    }
    /// The GID at the chosen index.
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }
    /// The port's active MTU.
    pub fn mtu(&self) -> Mtu {
        self.mtu
    }
    /// Whether the port is Ethernet (RoCE): every packet then needs a global route header.
    pub fn is_ethernet(&self) -> bool {
        self.ethernet
    }
    /// Largest completion queue the device supports.
    pub fn max_cqe(&self) -> i32 {
        self.max_cqe
    }
    /// Largest work queue the device supports.
    pub fn max_qp_wr(&self) -> i32 {
        self.max_qp_wr
    }
    pub(crate) fn ctx(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }
    pub(crate) fn pd(&self) -> *mut ffi::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every object created from the PD and context holds an Arc<Device>, so none
        // is alive now; each handle is freed once, PD before context.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd.as_ptr());
            ffi::ibv_close_device(self.ctx.as_ptr());
        }
    }
}
