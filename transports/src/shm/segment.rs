//! The shared segment: an anonymous memory file (memfd) sealed against resizing, mapped by
//! both ends of a pair.
//!
//! The creator makes the file, sizes it and seals it (`F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL`) before the descriptor leaves the process, so the peer can never shrink it
//! under a mapping (which would turn every access past the new end into SIGBUS). The receiver
//! checks the seals and the size before it maps anything. A memfd has no name in any file
//! system: it disappears when the last descriptor and mapping go, so nothing is left behind
//! after SIGKILL and there is nothing to unlink.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// Seals every segment carries; a received segment without them is refused.
const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// A shared mapping of a whole segment; unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through raw pointers with
// atomics for the control words (see `ring`), so sharing the handle between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping made by `map` and not unmapped elsewhere.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Mapping {
    /// Creates a sealed memfd of `len` bytes named `name` (shown in /proc/PID/maps) and maps
    /// it. Returns the mapping and the descriptor to pass to the peer.
    pub(crate) fn create(name: &str, len: usize) -> Result<(Self, OwnedFd), String> {
        let cname = std::ffi::CString::new(name).map_err(|_| "segment name contains a NUL byte".to_owned())?;
        // SAFETY: cname is a valid C string; the flags are valid memfd flags.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(os_error("cannot create the shared-memory segment (memfd_create)"));
        }
        // SAFETY: raw is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| format!("segment of {len} bytes is too large"))?;
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_error(&format!("cannot size the shared-memory segment to {len} bytes (ftruncate)")));
        }
        // SAFETY: fd is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS | libc::F_SEAL_SEAL) } != 0 {
            return Err(os_error("cannot seal the shared-memory segment"));
        }
        let mapping = Self::map(&fd, len)?;
        Ok((mapping, fd))
    }

    /// Maps a segment received from a peer after checking that it is sealed against resizing
    /// and exactly `len` bytes long.
    pub(crate) fn open(fd: &OwnedFd, len: usize) -> Result<Self, String> {
        // SAFETY: fd is a valid descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(os_error("the received segment is not a sealable memory file"));
        }
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(format!("the received segment is not sealed against resizing (seals {seals:#x})"));
        }
        // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is valid and st is a valid out pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat of the received segment"));
        }
        if u64::try_from(st.st_size).ok() != Some(len as u64) {
            return Err(format!("the received segment has {} bytes, {len} expected", st.st_size));
        }
        Self::map(fd, len)
    }

    fn map(fd: &OwnedFd, len: usize) -> Result<Self, String> {
        if len == 0 {
            return Err("empty shared-memory segment".into());
        }
        // SAFETY: mapping a valid descriptor of at least len bytes, shared, read-write.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(&format!("cannot map the shared-memory segment of {len} bytes")));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or("mmap returned a null pointer")?;
        Ok(Self { ptr, len })
    }

    /// Start of the mapping.
    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_that_cannot_be_created_is_a_clear_error() {
        // Far beyond any address space: the kernel refuses the mapping (or the size).
        let e = match Mapping::create("cohort-test", 1 << 50) {
            Ok(_) => panic!("a 1 PiB segment was mapped"),
            Err(e) => e,
        };
        assert!(e.contains("shared-memory segment"), "{e}");
    }

    #[test]
    fn an_unsealed_or_wrong_sized_segment_is_refused() {
        let (_m, fd) = Mapping::create("cohort-test", 4096).expect("segment");
        let e = Mapping::open(&fd, 8192).err().expect("wrong size accepted");
        assert!(e.contains("4096 bytes, 8192 expected"), "{e}");
        assert!(Mapping::open(&fd, 4096).is_ok());
        // A memfd without seals, as a careless or hostile peer might send.
        let name = std::ffi::CString::new("cohort-unsealed").unwrap();
        // SAFETY: valid name and flags.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let e = Mapping::open(&fd, 4096).err().expect("unsealed accepted");
        assert!(e.contains("not sealed") || e.contains("not a sealable"), "{e}");
    }
}
