//! The runtime threads: take tasks from the host queue, run the handler,
//! answer. Everything unsafe about the C ABI stays in this file.

use std::ffi::c_void;
use std::os::raw::{c_char, c_int};
use std::ptr;
use std::slice;
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crate::sys::{self, Host, LoomInitArgs, Queue, Task};
use crate::{catch, catch_panic, Call, Config, Error, Handler};

/// How long a thread blocks in host->wait() before looking again; the
/// host wakes waiters when it closes the queue, so this is only a bound.
const WAIT_MS: c_int = 1000;

/// Initial size of the answer buffer each thread reuses.
const OUT_KEEP: usize = 16 * 1024;

/// The host table and queue of one instance. The header makes every host
/// function thread-safe and both pointers valid until shutdown returns,
/// which is after every thread using them was joined.
#[derive(Clone, Copy)]
struct HostRef {
    host: *const Host,
    queue: *mut Queue,
}

unsafe impl Send for HostRef {}
unsafe impl Sync for HostRef {}

impl HostRef {
    fn host(&self) -> &Host {
        unsafe { &*self.host }
    }

    fn answer(&self, task: *mut Task, status: c_int, data: &[u8]) {
        unsafe {
            (self.host().answer)(
                task,
                status,
                data.as_ptr() as *const c_void,
                data.len(),
            );
        }
    }

    fn log(&self, level: c_int, msg: &str) {
        unsafe {
            (self.host().log)(
                self.queue,
                level,
                msg.as_ptr() as *const c_char,
                msg.len(),
            );
        }
    }
}

/// A started runtime, behind the `instance` pointer.
trait Stop {
    fn stop(self: Box<Self>);
}

struct Instance<H: Handler> {
    hr: HostRef,
    handler: Arc<H>,
    threads: Vec<JoinHandle<()>>,
}

impl<H: Handler> Stop for Instance<H> {
    fn stop(self: Box<Self>) {
        // The queue is closed: every thread leaves its loop once its
        // current call is done. A thread stuck in a call keeps us here;
        // the host stops waiting after its grace period.
        for t in self.threads {
            let _ = t.join();
        }
        let handler = self.handler;
        if let Err(e) = catch(|| {
            handler.shutdown();
            Ok(())
        }) {
            self.hr.log(
                sys::LOOM_OFFLOAD_LOG_ERR,
                &format!("shutdown failed: {}", e),
            );
        }
    }
}

#[repr(C)]
struct SigSet([u64; 16]);

extern "C" {
    fn sigfillset(set: *mut SigSet) -> c_int;
    fn sigdelset(set: *mut SigSet, sig: c_int) -> c_int;
    fn pthread_sigmask(
        how: c_int,
        set: *const SigSet,
        old: *mut SigSet,
    ) -> c_int;
}

/// Leaves every asynchronous signal to nginx's main thread (the host
/// already blocks them in the thread calling init; this keeps it so even
/// if a host does not). Faults stay deliverable, as in nginx's own
/// thread pool.
fn block_signals() {
    const SIG_BLOCK: c_int = 0;
    const FAULTS: [c_int; 4] = [4, 7, 8, 11]; // ILL, BUS, FPE, SEGV
    unsafe {
        let mut set = SigSet([0; 16]);
        sigfillset(&mut set);
        for s in FAULTS {
            sigdelset(&mut set, s);
        }
        pthread_sigmask(SIG_BLOCK, &set, ptr::null_mut());
    }
}

fn serve<H: Handler>(hr: HostRef, handler: &H, index: usize) {
    block_signals();
    let host = hr.host();
    let mut out: Vec<u8> = Vec::with_capacity(OUT_KEEP);
    loop {
        if out.capacity() > OUT_KEEP * 64 {
            // do not keep a huge answer's buffer for ever
            out = Vec::with_capacity(OUT_KEEP);
        }
        let mut task: *mut Task = ptr::null_mut();
        let rc = unsafe { (host.wait)(hr.queue, WAIT_MS, &mut task) };
        if rc == sys::LOOM_OFFLOAD_CLOSED {
            return;
        }
        if rc != sys::LOOM_OFFLOAD_TASK || task.is_null() {
            continue;
        }
        let mut len: usize = 0;
        let data = unsafe { (host.request)(task, &mut len) };
        let payload: &[u8] = if data.is_null() || len == 0 {
            &[]
        } else {
            unsafe { slice::from_raw_parts(data, len) }
        };
        let cancelled = || unsafe { (host.cancelled)(task) != 0 };
        let call = Call::new(payload, &cancelled, index);
        out.clear();
        match catch_panic(|| handler.handle_into(&call, &mut out)) {
            Ok(Ok(())) => hr.answer(task, sys::LOOM_OFFLOAD_OK, &out),
            Ok(Err(e)) => {
                hr.answer(task, sys::LOOM_OFFLOAD_ERROR, e.message().as_bytes())
            }
            Err(e) => {
                // a bug, not an answer: the log says so, once per panic
                hr.log(
                    sys::LOOM_OFFLOAD_LOG_ERR,
                    &format!(
                        "rust handler {} {}",
                        std::any::type_name::<H>(),
                        e.message()
                    ),
                );
                hr.answer(task, sys::LOOM_OFFLOAD_ERROR, e.message().as_bytes())
            }
        }
    }
}

unsafe fn set_err(args: &mut LoomInitArgs, msg: &str) {
    if args.err.is_null() || args.err_size == 0 {
        return;
    }
    let n = msg.len().min(args.err_size - 1);
    ptr::copy_nonoverlapping(msg.as_ptr(), args.err as *mut u8, n);
    *args.err.add(n) = 0;
}

fn start_threads<H: Handler>(
    hr: HostRef,
    handler: Arc<H>,
    n: usize,
) -> Result<Vec<JoinHandle<()>>, Error> {
    let mut threads = Vec::with_capacity(n);
    for i in 0..n {
        let h = handler.clone();
        let spawned = thread::Builder::new()
            .name(format!("loom-rs-{}", i))
            .spawn(move || serve(hr, &*h, i));
        match spawned {
            Ok(t) => threads.push(t),
            // Threads already started leave once the host closes the
            // queue, which it does when init fails.
            Err(e) => {
                return Err(Error::new(format!(
                    "failed to start thread: {}",
                    e
                )))
            }
        }
    }
    Ok(threads)
}

/// `loom_offload_init()` for handler type `H` (see `export_runtime!`).
///
/// # Safety
/// `args` must point to a valid `loom_offload_init_t` from the host.
pub unsafe fn start<H: Handler>(
    args: *mut LoomInitArgs,
    ctor: fn(&Config) -> Result<H, Error>,
) -> c_int {
    let args = match args.as_mut() {
        Some(a) => a,
        None => return -1,
    };
    if args.abi_version < sys::LOOM_OFFLOAD_ABI_VERSION
        || args.host.is_null()
        || ((*args.host).size as usize) < std::mem::size_of::<Host>()
    {
        set_err(args, "unsupported host ABI version");
        return -1;
    }
    let text = if args.config.is_null() || args.config_len == 0 {
        String::new()
    } else {
        let bytes =
            slice::from_raw_parts(args.config as *const u8, args.config_len);
        String::from_utf8_lossy(bytes).into_owned()
    };
    let nthreads = (args.threads as usize).max(1);
    let cfg = Config::new(text, nthreads, args.worker);
    let hr = HostRef {
        host: args.host,
        queue: args.queue,
    };

    let handler = match catch(|| ctor(&cfg)) {
        Ok(h) => Arc::new(h),
        Err(e) => {
            set_err(args, &format!("failed to create handler: {}", e));
            return -1;
        }
    };
    let threads = match start_threads(hr, handler.clone(), nthreads) {
        Ok(t) => t,
        Err(e) => {
            set_err(args, &e.to_string());
            return -1;
        }
    };
    let inst: Box<dyn Stop> = Box::new(Instance {
        hr,
        handler,
        threads,
    });
    args.instance = Box::into_raw(Box::new(inst)) as *mut c_void;
    0
}

/// `loom_offload_shutdown()`.
///
/// # Safety
/// `instance` must be a pointer `start()` stored, passed once.
pub unsafe fn stop(instance: *mut c_void) {
    if instance.is_null() {
        return;
    }
    let outer = Box::from_raw(instance as *mut Box<dyn Stop>);
    let inner: Box<dyn Stop> = *outer;
    inner.stop();
}
