//! Zero-copy views of Python buffers: objects with the buffer protocol (NumPy arrays,
//! bytearray, memoryview) and contiguous CPU torch tensors (through `data_ptr()`, which also
//! covers `torch.bfloat16`, a dtype NumPy lacks).
//!
//! A [`Buf`] holds the exporter (a `Py_buffer` export, or the tensor and its storage) for as
//! long as a collective uses its memory, so the memory cannot be freed or (for NumPy) resized
//! meanwhile. A tensor cannot be pinned that way: holding its storage keeps the memory alive
//! through `set_` (the tensor moved to other memory) and the tensor's deletion, but a
//! `resize_` that grows the storage frees the old memory whatever holds it. So after the call
//! [`Buf::check_unchanged`] compares the tensor's `data_ptr()`, size and storage with what the
//! call used, and a change raises instead of returning as if the result were in the tensor.
//! Do not resize or re-point a tensor from another thread while a collective runs on it (the
//! rule torch.distributed has too).

use crate::errors::invalid;
use cohort::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static TENSOR_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// What keeps a buffer's memory alive.
enum Holder {
    /// A buffer-protocol export, released (with the GIL) on drop.
    Export(Box<ffi::Py_buffer>),
    /// A torch tensor, its storage, and what the call used (to check after it).
    Tensor(Box<TensorHold>),
    /// Nothing (an empty buffer of a known dtype).
    None,
}

/// A tensor as a call found it.
struct TensorHold {
    tensor: Py<PyAny>,
    /// Its storage (`untyped_storage()`, `storage()` on torch 1.13): alive while it is held,
    /// whatever `set_` does to the tensor.
    storage: Py<PyAny>,
    /// The storage's `data_ptr()` when the call started.
    storage_ptr: usize,
}

/// A contiguous buffer of one dtype, in place.
pub(crate) struct Buf {
    ptr: *mut u8,
    bytes: usize,
    dtype: DType,
    holder: Holder,
}

// SAFETY: the memory is only touched through the slices below, by one collective at a time;
// the holder is released with the GIL held (Drop attaches).
unsafe impl Send for Buf {}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Holder::Export(view) = &mut self.holder {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // exactly once, with the GIL held.
            Python::attach(|_py| unsafe { ffi::PyBuffer_Release(&mut **view) });
        }
    }
}

impl Buf {
    /// Views `obj` in place; `writable` asks for write access.
    pub(crate) fn new(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Buf> {
        if let Some(tensor_type) = tensor_type(obj.py())? {
            if obj.is_instance(tensor_type.bind(obj.py()))? {
                return Self::from_tensor(obj, what);
            }
        }
        Self::from_buffer(obj, writable, what)
    }

    fn from_buffer(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<Buf> {
        let mut view: Box<ffi::Py_buffer> = Box::new(ffi::Py_buffer::new());
        let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
        if writable {
            flags |= ffi::PyBUF_WRITABLE;
        }
        // SAFETY: obj is a live object; view is a valid Py_buffer to fill.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_default();
            let kind = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
            return Err(invalid(format!(
                "{what}: expected a C-contiguous{} NumPy array, buffer or CPU torch tensor, got {kind} ({cause})",
                if writable { ", writable" } else { "" }
            )));
        }
        // From here the export is released by Buf's Drop, whatever happens.
        let format = if view.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by the export.
            unsafe { std::ffi::CStr::from_ptr(view.format) }.to_string_lossy().into_owned()
        };
        let itemsize = usize::try_from(view.itemsize).unwrap_or(0);
        let bytes = usize::try_from(view.len).unwrap_or(0);
        let ptr = view.buf.cast::<u8>();
        let mut buf = Buf { ptr, bytes, dtype: DType::U8, holder: Holder::Export(view) };
        let dtype = dtype_of_format(&format, itemsize).ok_or_else(|| {
            invalid(format!(
                "{what}: element format {format:?} ({itemsize} bytes) is not supported; cohort reduces \
                 float32, float64, float16, bfloat16 (torch), int32, int64 and uint8"
            ))
        })?;
        buf.dtype = dtype;
        buf.aligned(what)
    }

    fn from_tensor(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Buf> {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(invalid(format!("{what}: the tensor is on {device}; cohort moves CPU tensors (call .cpu())")));
        }
        let layout = obj.getattr("layout")?.str()?.to_string();
        if layout != "torch.strided" {
            return Err(invalid(format!("{what}: {layout} tensors are not supported (dense tensors only)")));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(invalid(format!("{what}: the tensor is not contiguous (call .contiguous(), which copies)")));
        }
        let name = obj.getattr("dtype")?.str()?.to_string();
        let dtype = dtype_of_torch(&name).ok_or_else(|| {
            invalid(format!(
                "{what}: dtype {name} is not supported; cohort reduces float32, float64, float16, bfloat16, int32, int64 and uint8"
            ))
        })?;
        let numel: usize = obj.call_method0("numel")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let bytes = numel * dtype.size();
        let storage = storage_of(obj)?;
        let storage_ptr: usize = storage.call_method0("data_ptr")?.extract()?;
        let hold = TensorHold { tensor: obj.clone().unbind(), storage: storage.unbind(), storage_ptr };
        Buf { ptr: ptr as *mut u8, bytes, dtype, holder: Holder::Tensor(Box::new(hold)) }.aligned(what)
    }

    /// After a call: a tensor still has the memory the call used (the same `data_ptr()`, size
    /// and storage); else an error saying that the result is not in the tensor (another thread
    /// called `resize_` or `set_` on it meanwhile). Other buffers cannot change (their export
    /// pins them).
    pub(crate) fn check_unchanged(&self, py: Python<'_>) -> PyResult<()> {
        let Holder::Tensor(hold) = &self.holder else { return Ok(()) };
        let tensor = hold.tensor.bind(py);
        let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
        let numel: usize = tensor.call_method0("numel")?.extract()?;
        let storage = storage_of(tensor)?;
        let storage_ptr: usize = storage.call_method0("data_ptr")?.extract()?;
        let held_ptr: usize = hold.storage.bind(py).call_method0("data_ptr")?.extract()?;
        if ptr == self.ptr as usize
            && numel * self.dtype.size() == self.bytes
            && storage_ptr == hold.storage_ptr
            && held_ptr == hold.storage_ptr
        {
            return Ok(());
        }
        Err(crate::errors::cohort_error(format!(
            "a tensor's memory changed while a collective ran on it (resize_ or set_ from another thread?): \
             the call used {} bytes at {:#x}, the tensor now has {} bytes at {:#x}; the result is not in the tensor, \
             and a resize_ that reallocated freed the memory the collective wrote (do not resize or re-point a \
             tensor until its collective has returned)",
            self.bytes,
            self.ptr as usize,
            numel * self.dtype.size(),
            ptr
        )))
    }

    /// Refuses memory that is not aligned for its element type (a view at an odd offset).
    fn aligned(self, what: &str) -> PyResult<Buf> {
        if self.bytes > 0 && (self.ptr as usize) % self.dtype.size() != 0 {
            return Err(invalid(format!(
                "{what}: the buffer's memory is not aligned to its {}-byte elements",
                self.dtype.size()
            )));
        }
        Ok(self)
    }

    /// An empty buffer of `dtype` (a non-root's absent gather output, say).
    pub(crate) fn empty(dtype: DType) -> Buf {
        Buf { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), bytes: 0, dtype, holder: Holder::None }
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.bytes / self.dtype.size()
    }

    /// Whether the two buffers share any byte.
    pub(crate) fn overlaps(&self, other: &Buf) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.bytes > 0 && other.bytes > 0 && a < b + other.bytes && b < a + self.bytes
    }

    /// The start of the memory (dangling but aligned when empty).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// A tensor's storage object: `untyped_storage()` (torch 2.x), else `storage()` (torch 1.13).
fn storage_of<'py>(tensor: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if tensor.hasattr("untyped_storage")? {
        tensor.call_method0("untyped_storage")
    } else {
        tensor.call_method0("storage")
    }
}

/// `torch.Tensor`, once torch has been imported by the application (never imported here).
fn tensor_type(py: Python<'_>) -> PyResult<Option<&Py<PyType>>> {
    if let Some(t) = TENSOR_TYPE.get(py) {
        return Ok(Some(t));
    }
    let modules = PyModule::import(py, "sys")?.getattr("modules")?;
    let Ok(torch) = modules.get_item("torch") else {
        return Ok(None);
    };
    let tensor = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
    Ok(Some(TENSOR_TYPE.get_or_init(py, || tensor)))
}

/// The dtype of a buffer-protocol element format (`struct` module syntax, native order).
fn dtype_of_format(format: &str, itemsize: usize) -> Option<DType> {
    let code = format.trim_start_matches(['@', '=', '<']);
    if code.len() != 1 || format.starts_with(['>', '!']) && itemsize > 1 {
        return None;
    }
    let dtype = match (code, itemsize) {
        ("f", 4) => DType::F32,
        ("d", 8) => DType::F64,
        ("e", 2) => DType::F16,
        ("B" | "c", 1) => DType::U8,
        ("i" | "l" | "q" | "n", 4) => DType::I32,
        ("i" | "l" | "q" | "n", 8) => DType::I64,
        _ => return None,
    };
    Some(dtype)
}

/// The dtype of a torch dtype's name (`str(tensor.dtype)`).
fn dtype_of_torch(name: &str) -> Option<DType> {
    Some(match name {
        "torch.float32" => DType::F32,
        "torch.float64" => DType::F64,
        "torch.float16" => DType::F16,
        "torch.bfloat16" => DType::BF16,
        "torch.int32" => DType::I32,
        "torch.int64" => DType::I64,
        "torch.uint8" => DType::U8,
        _ => return None,
    })
}

/// Runs `$body` with `$E` bound to the Rust element type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            cohort::DType::F32 => {
                type $E = f32;
                $body
            }
            cohort::DType::F64 => {
                type $E = f64;
                $body
            }
            cohort::DType::F16 => {
                type $E = half::f16;
                $body
            }
            cohort::DType::BF16 => {
                type $E = half::bf16;
                $body
            }
            cohort::DType::I32 => {
                type $E = i32;
                $body
            }
            cohort::DType::I64 => {
                type $E = i64;
                $body
            }
            cohort::DType::U8 => {
                type $E = u8;
                $body
            }
        }
    };
}
pub(crate) use with_element;
