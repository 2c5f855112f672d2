//! Thin typed wrappers over the CUDA driver API (through cudarc's dynamically loaded bindings): device
//! buffers, streams, events, page-locked host registrations and kernel launches. Every call's status is
//! checked and returned as [`GpuError`].

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::GpuError;

pub(crate) fn check(what: &'static str, r: sys::CUresult) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver { what, code: format!("{r:?}") })
    }
}

/// The primary context of one device, made current on the calling thread by [`Device::bind`].
pub struct Device {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name as the driver reports it.
    pub name: String,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// Streaming multiprocessors.
    pub sms: i32,
    /// Largest dynamic shared memory a block may opt in to (bytes).
    pub max_smem_optin: i32,
    /// Peak SM clock (kHz).
    pub clock_khz: i32,
}

// SAFETY: a CUDA context handle may be used from any thread once made current there (Device::bind);
// the driver API is thread-safe.
unsafe impl Send for Device {}
// SAFETY: as above; the handle is never mutated after creation.
unsafe impl Sync for Device {}

impl Device {
    /// Initializes the driver and retains device `ordinal`'s primary context. Errors: no such device, driver
    /// failure.
    pub fn open(ordinal: usize) -> Result<Arc<Device>, GpuError> {
        // SAFETY: plain driver calls with valid out-pointers; the library was found by probe() before.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
            let mut ctx = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            let mut buf = [0 as std::ffi::c_char; 256];
            check("cuDeviceGetName", sys::cuDeviceGetName(buf.as_mut_ptr(), 255, dev))?;
            let name = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            let attr = |a: sys::CUdevice_attribute| -> Result<i32, GpuError> {
                let mut v = 0;
                check("cuDeviceGetAttribute", sys::cuDeviceGetAttribute(&mut v, a, dev))?;
                Ok(v)
            };
            use sys::CUdevice_attribute::*;
            let cc = (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let max_smem_optin = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            let clock_khz = attr(CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
            Ok(Arc::new(Device { ctx, dev, ordinal, name, cc, sms, max_smem_optin, clock_khz }))
        }
    }

    /// Makes the context current on the calling thread (each thread that touches the GPU calls this first).
    pub fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: ctx is a retained primary context, alive as long as self.
        unsafe { check("cuCtxSetCurrent", sys::cuCtxSetCurrent(self.ctx)) }
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        unsafe { check("cuMemGetInfo", sys::cuMemGetInfo_v2(&mut free, &mut total))? };
        Ok((free, total))
    }

    /// The architecture name NVRTC takes, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in open().
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Streaming multiprocessors of the device of the current context. Errors: no current context, the driver's.
pub fn current_sms() -> Result<u32, GpuError> {
    let (mut dev, mut v) = (0, 0);
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        check("cuCtxGetDevice", sys::cuCtxGetDevice(&mut dev))?;
        check(
            "cuDeviceGetAttribute",
            sys::cuDeviceGetAttribute(&mut v, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
        )?;
    }
    Ok(v.max(0) as u32)
}

/// Bytes of every [`DevBuf`] of this process not yet freed (the sizes asked, before the driver's rounding).
static LIVE_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes of device memory this process holds in [`DevBuf`]s now (the sizes asked): a load checks with it that
/// the placement plan's trial allocated what the load does.
pub fn live_bytes() -> u64 {
    LIVE_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// A device allocation of `bytes` bytes (freed on drop).
pub struct DevBuf {
    /// Device address.
    pub ptr: sys::CUdeviceptr,
    /// Size in bytes.
    pub bytes: usize,
}

// SAFETY: a device address is plain data; users order accesses with streams and events.
unsafe impl Send for DevBuf {}
// SAFETY: as above.
unsafe impl Sync for DevBuf {}

impl DevBuf {
    /// Allocates `bytes` (at least 1) of device memory (contents undefined). The allocation is rounded up to 16
    /// bytes, so a kernel may read a whole aligned word or 16-byte piece that holds a buffer's last byte (the
    /// pipelined tensor-core loop copies rows that start 2-byte aligned as whole words). Errors: out of memory.
    pub fn alloc(bytes: usize) -> Result<DevBuf, GpuError> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size > 0.
        unsafe { check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, bytes.max(1).next_multiple_of(16)))? };
        LIVE_BYTES.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(DevBuf { ptr, bytes })
    }

    /// Allocates and fills from `src` synchronously.
    pub fn from_slice<T: Copy>(src: &[T]) -> Result<DevBuf, GpuError> {
        let b = DevBuf::alloc(std::mem::size_of_val(src))?;
        b.write_sync(0, src)?;
        Ok(b)
    }

    /// Copies `src` to byte offset `off` synchronously. Errors: out of bounds, driver failure.
    pub fn write_sync<T: Copy>(&self, off: usize, src: &[T]) -> Result<(), GpuError> {
        let n = std::mem::size_of_val(src);
        if off + n > self.bytes {
            return Err(GpuError::Bounds { off, len: n, size: self.bytes });
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: destination range checked above; src is a live slice of n bytes.
        unsafe { check("cuMemcpyHtoD", sys::cuMemcpyHtoD_v2(self.ptr + off as u64, src.as_ptr() as *const c_void, n)) }
    }

    /// Copies byte offset `off` into `dst` synchronously. Errors: out of bounds, driver failure.
    pub fn read_sync<T: Copy>(&self, off: usize, dst: &mut [T]) -> Result<(), GpuError> {
        let n = std::mem::size_of_val(dst);
        if off + n > self.bytes {
            return Err(GpuError::Bounds { off, len: n, size: self.bytes });
        }
        // SAFETY: source range checked above; dst is a live mutable slice of n bytes.
        unsafe {
            check("cuMemcpyDtoH", sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, self.ptr + off as u64, n))
        }
    }

    /// Device address of byte `off`.
    pub fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc and is freed once.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
        LIVE_BYTES.fetch_sub(self.bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// An instantiated CUDA graph (see [`Stream::capture`]): one launch replays every captured kernel and copy.
pub struct GraphExec(sys::CUgraphExec);

// SAFETY: an executable graph may be launched from any thread with the context current (one launch at a time
// per owner, which holds it behind a lock).
unsafe impl Send for GraphExec {}
// SAFETY: as above.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// Enqueues the graph on `s`. Errors: launch failure.
    pub fn launch(&self, s: &Stream) -> Result<(), GpuError> {
        // SAFETY: live executable graph and stream.
        unsafe { check("cuGraphLaunch", sys::cuGraphLaunch(self.0, s.0)) }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the owner syncs its stream before dropping graphs it launched.
        unsafe {
            sys::cuGraphExecDestroy(self.0);
        }
    }
}

/// A non-blocking CUDA stream.
pub struct Stream(pub(crate) sys::CUstream);

// SAFETY: stream handles may be used from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a stream that does not synchronize with the null stream.
    pub fn new() -> Result<Stream, GpuError> {
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe {
            check("cuStreamCreate", sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?
        };
        Ok(Stream(s))
    }

    /// Records `enqueue`'s work on this stream into a CUDA graph instead of running it (capture mode
    /// thread-local: other threads' CUDA calls go on as usual) and returns the graph, instantiated. The
    /// captured work must not synchronize with the host. Errors: `enqueue`'s own error (the capture is ended
    /// and dropped first), or a capture / instantiation failure.
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<(), GpuError>) -> Result<GraphExec, GpuError> {
        // SAFETY: live stream; thread-local capture mode.
        unsafe {
            check(
                "cuStreamBeginCapture",
                sys::cuStreamBeginCapture_v2(self.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            )?
        };
        let r = enqueue();
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above (also after a failed enqueue, so the stream is usable again).
        let end = unsafe { check("cuStreamEndCapture", sys::cuStreamEndCapture(self.0, &mut graph)) };
        let result = r.and(end).and_then(|_| {
            let mut exec = std::ptr::null_mut();
            // SAFETY: `graph` is the captured graph; valid out-pointer.
            unsafe { check("cuGraphInstantiate", sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0))? };
            Ok(GraphExec(exec))
        });
        if !graph.is_null() {
            // SAFETY: the template is no longer needed once instantiated (or on failure).
            unsafe { sys::cuGraphDestroy(graph) };
        }
        result
    }

    /// Blocks until the stream's work is done.
    pub fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: live stream.
        unsafe { check("cuStreamSynchronize", sys::cuStreamSynchronize(self.0)) }
    }

    /// Later work on this stream waits for `ev`.
    pub fn wait(&self, ev: &Event) -> Result<(), GpuError> {
        // SAFETY: live stream and event.
        unsafe { check("cuStreamWaitEvent", sys::cuStreamWaitEvent(self.0, ev.0, 0)) }
    }

    /// Asynchronous host → device copy of `n` bytes from `src`.
    ///
    /// # Safety
    /// `src` must stay valid (and unmodified) until the copy completes; for overlap it should be page-locked.
    pub unsafe fn htod_raw(&self, dst: u64, src: *const u8, n: usize) -> Result<(), GpuError> {
        check("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, n, self.0))
    }

    /// Asynchronous host → device copy of `height` rows of `width` bytes: row i from `src + i * src_pitch` to
    /// `dst + i * dst_pitch` (a column range of a row-major matrix, packed).
    ///
    /// # Safety
    /// As [`Stream::htod_raw`], for every source row.
    pub unsafe fn htod_2d_raw(
        &self,
        dst: u64,
        dst_pitch: usize,
        src: *const u8,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<(), GpuError> {
        let p = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            srcHost: src as *const c_void,
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        check("cuMemcpy2DAsync", sys::cuMemcpy2DAsync_v2(&p, self.0))
    }

    /// Asynchronous device → host copy of `n` bytes into `dst`.
    ///
    /// # Safety
    /// `dst` must stay valid and untouched by the host until the copy completes.
    pub unsafe fn dtoh_raw(&self, dst: *mut u8, src: u64, n: usize) -> Result<(), GpuError> {
        check("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, n, self.0))
    }

    /// Asynchronous device → device copy.
    pub fn dtod(&self, dst: u64, src: u64, n: usize) -> Result<(), GpuError> {
        // SAFETY: device addresses; the caller's buffers cover the ranges.
        unsafe { check("cuMemcpyDtoDAsync", sys::cuMemcpyDtoDAsync_v2(dst, src, n, self.0)) }
    }

    /// Copies `src` to the device synchronously with respect to the host (stream-ordered, then waits).
    pub fn htod_sync<T: Copy>(&self, dst: u64, src: &[T]) -> Result<(), GpuError> {
        // SAFETY: src lives until sync() returns below.
        unsafe { self.htod_raw(dst, src.as_ptr() as *const u8, std::mem::size_of_val(src))? };
        self.sync()
    }

    /// Reads device memory into `dst` after the stream's earlier work (waits).
    pub fn dtoh_sync<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), GpuError> {
        // SAFETY: dst lives and is not touched until sync() returns below.
        unsafe { self.dtoh_raw(dst.as_mut_ptr() as *mut u8, src, std::mem::size_of_val(dst))? };
        self.sync()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe {
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

/// A CUDA event (timing enabled when made with [`Event::timed`]).
pub struct Event(pub(crate) sys::CUevent);

// SAFETY: event handles may be used from any thread with the context current.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// An event without timing (cheapest to record and wait on).
    pub fn new() -> Result<Event, GpuError> {
        Self::with_flags(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }
    /// An event with timing.
    pub fn timed() -> Result<Event, GpuError> {
        Self::with_flags(sys::CUevent_flags::CU_EVENT_DEFAULT)
    }
    fn with_flags(f: sys::CUevent_flags) -> Result<Event, GpuError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe { check("cuEventCreate", sys::cuEventCreate(&mut e, f as u32))? };
        Ok(Event(e))
    }
    /// Records the event at the current end of `s`.
    pub fn record(&self, s: &Stream) -> Result<(), GpuError> {
        // SAFETY: live event and stream.
        unsafe { check("cuEventRecord", sys::cuEventRecord(self.0, s.0)) }
    }
    /// Records the event at the current end of `s` so that the host can wait for it also when `s` is being
    /// captured into a graph (an external event-record node: the graph's replays record it).
    pub fn record_external(&self, s: &Stream) -> Result<(), GpuError> {
        let flags = sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32;
        // SAFETY: live event and stream.
        unsafe { check("cuEventRecordWithFlags", sys::cuEventRecordWithFlags(self.0, s.0, flags)) }
    }
    /// Whether the work before the last record is done (never blocks).
    pub fn done(&self) -> Result<bool, GpuError> {
        // SAFETY: live event.
        let r = unsafe { sys::cuEventQuery(self.0) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => check("cuEventQuery", e).map(|_| false),
        }
    }
    /// Blocks until the event completed.
    pub fn sync(&self) -> Result<(), GpuError> {
        // SAFETY: live event.
        unsafe { check("cuEventSynchronize", sys::cuEventSynchronize(self.0)) }
    }
    /// Milliseconds between `start` and this event (both timed and completed).
    pub fn since_ms(&self, start: &Event) -> Result<f32, GpuError> {
        let mut ms = 0f32;
        // SAFETY: valid out-pointer, live events.
        unsafe { check("cuEventElapsedTime", sys::cuEventElapsedTime_v2(&mut ms, start.0, self.0))? };
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// Page-locks (registers with the driver) an existing host range so device copies from it run at full link
/// speed. Errors: the driver refused (e.g. RLIMIT_MEMLOCK in a container); callers go on pageable.
///
/// # Safety
/// `ptr..ptr+bytes` must stay mapped until [`host_unregister`] is called.
pub unsafe fn host_register(ptr: *mut u8, bytes: usize) -> Result<(), GpuError> {
    // CU_MEMHOSTREGISTER_PORTABLE (1): page-locked for every context, so every card of a layer split copies
    // from the one registration
    check("cuMemHostRegister", sys::cuMemHostRegister_v2(ptr as *mut c_void, bytes, 1))
}

/// Undoes [`host_register`].
///
/// # Safety
/// `ptr` must have been registered and no copy from it may be in flight.
pub unsafe fn host_unregister(ptr: *mut u8) {
    sys::cuMemHostUnregister(ptr as *mut c_void);
}

/// Page-locked host memory allocated by the driver (freed on drop).
pub struct PinnedBuf {
    ptr: *mut u8,
    /// Size in bytes.
    pub bytes: usize,
}

// SAFETY: plain host memory; users order accesses with events.
unsafe impl Send for PinnedBuf {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// Allocates `bytes` of page-locked host memory. Errors: driver refusal.
    pub fn alloc(bytes: usize) -> Result<PinnedBuf, GpuError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe { check("cuMemHostAlloc", sys::cuMemHostAlloc(&mut p, bytes.max(1), 0))? };
        Ok(PinnedBuf { ptr: p as *mut u8, bytes })
    }
    /// Start address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Copies `src` (plain numbers) to byte offset `off` (no device copy may be in flight over that range).
    /// Panics when the range is outside the buffer.
    pub fn write<T: Copy>(&mut self, off: usize, src: &[T]) {
        let n = std::mem::size_of_val(src);
        assert!(off + n <= self.bytes, "pinned write of {n} bytes at {off} outside {} bytes", self.bytes);
        // SAFETY: the range is inside the allocation (checked); exclusive through &mut self; src is n live bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, self.ptr.add(off), n) };
    }
    /// Copies the bytes at offset `off` into `dst` (plain numbers; every bit pattern of the bytes the device
    /// wrote there is a valid value of `T`: i32 / f32). Panics when the range is outside the buffer.
    pub fn read<T: Copy>(&self, off: usize, dst: &mut [T]) {
        let n = std::mem::size_of_val(dst);
        assert!(off + n <= self.bytes, "pinned read of {n} bytes at {off} outside {} bytes", self.bytes);
        // SAFETY: the range is inside the allocation (checked); dst is n writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr() as *mut u8, n) };
    }
    /// The bytes, mutable (no device copy from them may be in flight).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusive through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        unsafe {
            sys::cuMemFreeHost(self.ptr as *mut c_void);
        }
    }
}

/// Most arguments an [`Args`] holds (the longest list, `qkv_rope_store`'s, has 16).
const MAX_ARGS: usize = 24;

/// A kernel argument list for [`Func::launch`]: up to 24 arguments of at most 8 bytes, stored inline (no
/// allocation per launch).
pub struct Args {
    vals: [u64; MAX_ARGS],
    n: usize,
}

impl Default for Args {
    fn default() -> Self {
        Self::new()
    }
}

impl Args {
    /// Empty.
    pub fn new() -> Self {
        Args { vals: [0; MAX_ARGS], n: 0 }
    }
    fn push(mut self, v: u64) -> Self {
        assert!(self.n < MAX_ARGS, "more than {MAX_ARGS} kernel arguments");
        self.vals[self.n] = v;
        self.n += 1;
        self
    }
    /// A device pointer (or 0 for null).
    pub fn ptr(self, p: u64) -> Self {
        self.push(p)
    }
    /// A 32-bit integer (the driver reads the low 4 bytes; little-endian).
    pub fn i32(self, v: i32) -> Self {
        self.push(v as u32 as u64)
    }
    /// A 32-bit float.
    pub fn f32(self, v: f32) -> Self {
        self.push(v.to_bits() as u64)
    }
    /// A 64-bit size.
    pub fn usize(self, v: usize) -> Self {
        self.push(v as u64)
    }
}

/// A kernel function of a loaded module.
#[derive(Clone, Copy)]
pub struct Func {
    pub(crate) f: sys::CUfunction,
    /// Kernel name.
    pub name: &'static str,
    /// Launch with programmatic stream serialization (programmatic dependent launch, sm_90+): the kernel may
    /// start launching while the previous one in the stream finishes; the kernels wait for it themselves
    /// (`griddepcontrol.wait` in `pdl_entry`, kernels/strata.cu).
    pub pdl: bool,
}

// SAFETY: function handles are immutable and usable from any thread with the context current.
unsafe impl Send for Func {}
// SAFETY: as above.
unsafe impl Sync for Func {}

impl Func {
    /// Launches on `s` with `grid` blocks of `block` threads and `smem` bytes of dynamic shared memory.
    /// Errors: launch failure (bad configuration, missing resources).
    pub fn launch(&self, s: &Stream, grid: (u32, u32, u32), block: u32, smem: u32, args: Args) -> Result<(), GpuError> {
        let mut args = args;
        let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, v) in ptrs.iter_mut().zip(args.vals.iter_mut()).take(args.n) {
            *p = v as *mut u64 as *mut c_void;
        }
        if self.pdl {
            // SAFETY: a zeroed launch attribute is valid plain data; the id and the union member set match.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: s.0,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for cuLaunchKernel below; `cfg` and `attr` outlive the call.
            return unsafe {
                check(self.name, sys::cuLaunchKernelEx(&cfg, self.f, ptrs.as_mut_ptr(), std::ptr::null_mut()))
            };
        }
        // SAFETY: the argument list matches the kernel's parameters (each call site mirrors the .cu signature);
        // the driver copies the values at launch; `args` outlives the call.
        unsafe {
            check(
                self.name,
                sys::cuLaunchKernel(
                    self.f,
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    1,
                    1,
                    smem,
                    s.0,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            )
        }
    }

    /// Blocks of `block` threads with `smem` bytes of dynamic shared memory each that one SM runs at once (the
    /// driver's occupancy calculator: registers, shared memory, warps). Errors: the driver's.
    pub fn blocks_per_sm(&self, block: u32, smem: u32) -> Result<u32, GpuError> {
        let mut n = 0i32;
        // SAFETY: live function handle and a valid out-pointer.
        unsafe {
            check(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.f, block as i32, smem as usize),
            )?
        };
        Ok(n.max(0) as u32)
    }

    /// Raises the kernel's dynamic shared memory limit to `bytes`.
    pub fn set_max_smem(&self, bytes: i32) -> Result<(), GpuError> {
        // SAFETY: live function handle.
        unsafe {
            check(
                "cuFuncSetAttribute",
                sys::cuFuncSetAttribute(
                    self.f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes,
                ),
            )
        }
    }
}
