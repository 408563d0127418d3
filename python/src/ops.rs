//! One collective call, validated and ready to run: the arguments checked here are the ones
//! the crate would reject only after poisoning the communicator, so that a bad call from
//! Python raises `InvalidArgumentError` and changes nothing.

use crate::buffer::{with_element, Buf};
use cohort::elastic::MeshTransport;
use cohort::{CommError, Communicator, DType, ReduceOp};

/// A buffer's memory as the operation uses it (the [`Buf`] that owns it outlives the op).
#[derive(Clone, Copy)]
pub(crate) struct View {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
}

// SAFETY: a View is only dereferenced by the one operation it was made for, while the Buf
// holding its memory is alive (the caller or the Work keeps it).
unsafe impl Send for View {}
unsafe impl Sync for View {}

impl View {
    fn of(buf: &Buf) -> View {
        View { ptr: buf.as_ptr(), len: buf.len(), dtype: buf.dtype() }
    }

    /// # Safety
    /// `E` is the view's dtype; no overlapping slice is used at the same time.
    unsafe fn slice<'a, E>(self) -> &'a mut [E] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: see the type's invariant and the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<E>(), self.len) }
    }
}

/// A collective with its buffers.
pub(crate) enum Op {
    Allreduce { buf: View, op: ReduceOp },
    ReduceScatter { input: View, output: View, op: ReduceOp },
    Allgather { input: View, output: View },
    Broadcast { buf: View, root: u32 },
    Reduce { buf: View, root: u32, op: ReduceOp },
    Gather { input: View, output: View, root: u32 },
    Scatter { input: View, output: View, root: u32 },
    Alltoall { input: View, output: View },
    Barrier,
    Send { buf: View, peer: u32 },
    Recv { buf: View, peer: u32 },
}

/// An operation and the private copies it reads from (an input that overlaps its output is
/// copied first, so that in-place calls such as an allgather whose input is the rank's own
/// block of the output are well defined).
pub(crate) struct Prepared {
    pub(crate) op: Op,
    _copies: Vec<Vec<u64>>,
}

/// Shape facts of the communicator a call is checked against.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) rank: u32,
    pub(crate) size: u32,
}

pub(crate) fn parse_op(name: &str) -> Result<ReduceOp, String> {
    name.parse::<ReduceOp>().map_err(|e| e.to_string())
}

fn same_dtype(what: &str, a: &Buf, b: &Buf) -> Result<(), String> {
    if a.dtype() != b.dtype() {
        return Err(format!("{what}: input is {} but output is {}", a.dtype(), b.dtype()));
    }
    Ok(())
}

fn root_ok(what: &str, root: u32, shape: Shape) -> Result<(), String> {
    if root >= shape.size {
        return Err(format!("{what}: root {root} out of range for {} ranks", shape.size));
    }
    Ok(())
}

fn lengths(what: &str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: {}", detail()))
    }
}

/// An input view, copied to private memory when it overlaps the output.
fn input_view(input: &Buf, output: &Buf, copies: &mut Vec<Vec<u64>>) -> View {
    let view = View::of(input);
    if !input.overlaps(output) {
        return view;
    }
    let bytes = input.len() * input.dtype().size();
    let mut copy = vec![0u64; bytes.div_ceil(8)];
    // SAFETY: the source covers `bytes` bytes of live memory; the copy is at least as long
    // and does not overlap it.
    unsafe { std::ptr::copy_nonoverlapping(view.ptr, copy.as_mut_ptr().cast::<u8>(), bytes) };
    let ptr = copy.as_mut_ptr().cast::<u8>();
    copies.push(copy);
    View { ptr, ..view }
}

impl Prepared {
    /// An operation with an input and an output buffer (the input copied when they overlap).
    fn in_out(input: &Buf, output: &Buf, make: impl FnOnce(View, View) -> Op) -> Prepared {
        let mut copies = Vec::new();
        let input = input_view(input, output, &mut copies);
        Prepared { op: make(input, View::of(output)), _copies: copies }
    }

    fn plain(op: Op) -> Result<Prepared, String> {
        Ok(Prepared { op, _copies: Vec::new() })
    }

    pub(crate) fn allreduce(buf: &Buf, op: ReduceOp) -> Result<Prepared, String> {
        Self::plain(Op::Allreduce { buf: View::of(buf), op })
    }

    pub(crate) fn reduce_scatter(input: &Buf, output: &Buf, op: ReduceOp, shape: Shape) -> Result<Prepared, String> {
        same_dtype("reduce_scatter", input, output)?;
        lengths("reduce_scatter", input.len() == output.len() * shape.size as usize, || {
            format!(
                "input has {} elements, expected {} ranks x {} (the output's length)",
                input.len(),
                shape.size,
                output.len()
            )
        })?;
        Ok(Self::in_out(input, output, |input, output| Op::ReduceScatter { input, output, op }))
    }

    pub(crate) fn allgather(input: &Buf, output: &Buf, shape: Shape) -> Result<Prepared, String> {
        same_dtype("allgather", input, output)?;
        lengths("allgather", output.len() == input.len() * shape.size as usize, || {
            format!(
                "output has {} elements, expected {} ranks x {} (the input's length)",
                output.len(),
                shape.size,
                input.len()
            )
        })?;
        Ok(Self::in_out(input, output, |input, output| Op::Allgather { input, output }))
    }

    pub(crate) fn broadcast(buf: &Buf, root: u32, shape: Shape) -> Result<Prepared, String> {
        root_ok("broadcast", root, shape)?;
        Self::plain(Op::Broadcast { buf: View::of(buf), root })
    }

    pub(crate) fn reduce(buf: &Buf, root: u32, op: ReduceOp, shape: Shape) -> Result<Prepared, String> {
        root_ok("reduce", root, shape)?;
        Self::plain(Op::Reduce { buf: View::of(buf), root, op })
    }

    pub(crate) fn gather(input: &Buf, output: &Buf, root: u32, shape: Shape) -> Result<Prepared, String> {
        root_ok("gather", root, shape)?;
        if shape.rank == root {
            same_dtype("gather", input, output)?;
            lengths("gather", output.len() == input.len() * shape.size as usize, || {
                format!(
                    "the root's output has {} elements, expected {} ranks x {}",
                    output.len(),
                    shape.size,
                    input.len()
                )
            })?;
        }
        Ok(Self::in_out(input, output, |input, output| Op::Gather { input, output, root }))
    }

    pub(crate) fn scatter(input: &Buf, output: &Buf, root: u32, shape: Shape) -> Result<Prepared, String> {
        root_ok("scatter", root, shape)?;
        if shape.rank == root {
            same_dtype("scatter", input, output)?;
            lengths("scatter", input.len() == output.len() * shape.size as usize, || {
                format!(
                    "the root's input has {} elements, expected {} ranks x {}",
                    input.len(),
                    shape.size,
                    output.len()
                )
            })?;
        }
        Ok(Self::in_out(input, output, |input, output| Op::Scatter { input, output, root }))
    }

    pub(crate) fn alltoall(input: &Buf, output: &Buf, shape: Shape) -> Result<Prepared, String> {
        same_dtype("alltoall", input, output)?;
        lengths("alltoall", input.len() == output.len() && input.len() % shape.size as usize == 0, || {
            format!(
                "input has {} elements and output {}: both must be equal and divisible by {} ranks",
                input.len(),
                output.len(),
                shape.size
            )
        })?;
        Ok(Self::in_out(input, output, |input, output| Op::Alltoall { input, output }))
    }

    pub(crate) fn barrier() -> Result<Prepared, String> {
        Self::plain(Op::Barrier)
    }

    pub(crate) fn point_to_point(buf: &Buf, peer: u32, send: bool, shape: Shape) -> Result<Prepared, String> {
        let what = if send { "send" } else { "recv" };
        if peer >= shape.size || peer == shape.rank {
            return Err(format!(
                "{what}: peer {peer} is not another rank of {} (this is rank {})",
                shape.size, shape.rank
            ));
        }
        let buf = View::of(buf);
        Self::plain(if send { Op::Send { buf, peer } } else { Op::Recv { buf, peer } })
    }
}

/// Runs `op` on `comm`.
///
/// # Cancel safety
/// Not cancel safe, as every collective: dropping it aborts the communicator's transport.
pub(crate) async fn execute(comm: &mut Communicator<MeshTransport>, op: &Op) -> Result<(), CommError> {
    // SAFETY (every slice below): the views were made from live buffers of the named dtype,
    // kept alive by the caller; an input that overlapped its output was copied.
    unsafe {
        match *op {
            Op::Allreduce { buf, op } => with_element!(buf.dtype, E => comm.allreduce(buf.slice::<E>(), op).await),
            Op::ReduceScatter { input, output, op } => {
                with_element!(input.dtype, E => comm.reduce_scatter(input.slice::<E>(), output.slice::<E>(), op).await)
            }
            Op::Allgather { input, output } => {
                with_element!(input.dtype, E => comm.allgather(input.slice::<E>(), output.slice::<E>()).await)
            }
            Op::Broadcast { buf, root } => with_element!(buf.dtype, E => comm.broadcast(buf.slice::<E>(), root).await),
            Op::Reduce { buf, root, op } => {
                with_element!(buf.dtype, E => comm.reduce(buf.slice::<E>(), op, root).await)
            }
            Op::Gather { input, output, root } => {
                with_element!(input.dtype, E => comm.gather(input.slice::<E>(), output.slice::<E>(), root).await)
            }
            Op::Scatter { input, output, root } => {
                with_element!(output.dtype, E => comm.scatter(input.slice::<E>(), output.slice::<E>(), root).await)
            }
            Op::Alltoall { input, output } => {
                with_element!(input.dtype, E => comm.alltoall(input.slice::<E>(), output.slice::<E>()).await)
            }
            Op::Barrier => comm.barrier().await,
            Op::Send { buf, peer } => with_element!(buf.dtype, E => comm.send(buf.slice::<E>(), peer).await),
            Op::Recv { buf, peer } => with_element!(buf.dtype, E => comm.recv(buf.slice::<E>(), peer).await),
        }
    }
}
