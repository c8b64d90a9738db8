//! The runtime engine against a mock host table (no nginx): results,
//! errors, panics, state, cancellation, shutdown, start-up failures and
//! many concurrent tasks.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::os::raw::{c_char, c_int, c_uchar};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use loom_offload::sys::{self, Host, LoomInitArgs, Queue, Task};
use loom_offload::{Call, Config, Error, Handler};

struct MockTask {
    id: usize,
    req: Vec<u8>, // with a trailing NUL, as the host promises
    cancelled: AtomicBool,
    done: Sender<(usize, c_int, Vec<u8>)>,
}

struct MockQueue {
    tasks: Mutex<(VecDeque<Box<MockTask>>, bool)>,
    cond: Condvar,
    logs: Mutex<Vec<String>>,
}

unsafe extern "C" fn mock_wait(
    q: *mut Queue,
    timeout_ms: c_int,
    task: *mut *mut Task,
) -> c_int {
    let q = &*(q as *const MockQueue);
    let mut g = q.tasks.lock().unwrap();
    loop {
        if let Some(t) = g.0.pop_front() {
            *task = Box::into_raw(t) as *mut Task;
            return sys::LOOM_OFFLOAD_TASK;
        }
        if g.1 {
            *task = ptr::null_mut();
            return sys::LOOM_OFFLOAD_CLOSED;
        }
        let (ng, res) = q
            .cond
            .wait_timeout(g, Duration::from_millis(timeout_ms as u64))
            .unwrap();
        g = ng;
        if res.timed_out() && g.0.is_empty() && !g.1 {
            return sys::LOOM_OFFLOAD_TIMEDOUT;
        }
    }
}

unsafe extern "C" fn mock_request(
    t: *mut Task,
    len: *mut usize,
) -> *const c_uchar {
    let t = &*(t as *const MockTask);
    *len = t.req.len() - 1;
    t.req.as_ptr()
}

unsafe extern "C" fn mock_cancelled(t: *mut Task) -> c_int {
    (*(t as *const MockTask)).cancelled.load(Ordering::SeqCst) as c_int
}

unsafe extern "C" fn mock_answer(
    t: *mut Task,
    status: c_int,
    data: *const c_void,
    len: usize,
) -> c_int {
    let t = Box::from_raw(t as *mut MockTask);
    let bytes = if len == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(data as *const u8, len).to_vec()
    };
    let _ = t.done.send((t.id, status, bytes));
    0
}

unsafe extern "C" fn mock_log(
    q: *mut Queue,
    _level: c_int,
    msg: *const c_char,
    len: usize,
) {
    let q = &*(q as *const MockQueue);
    let s = std::slice::from_raw_parts(msg as *const u8, len);
    q.logs
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(s).into_owned());
}

static HOST: Host = Host {
    abi_version: 1,
    size: std::mem::size_of::<Host>() as u32,
    wait: mock_wait,
    request: mock_request,
    cancelled: mock_cancelled,
    answer: mock_answer,
    log: mock_log,
};

struct Harness {
    queue: Box<MockQueue>,
    instance: *mut c_void,
    tx: Sender<(usize, c_int, Vec<u8>)>,
    rx: Receiver<(usize, c_int, Vec<u8>)>,
    next: usize,
}

fn start<H: Handler>(
    config: &str,
    threads: u32,
    ctor: fn(&Config) -> Result<H, Error>,
) -> Result<Harness, String> {
    let queue = Box::new(MockQueue {
        tasks: Mutex::new((VecDeque::new(), false)),
        cond: Condvar::new(),
        logs: Mutex::new(Vec::new()),
    });
    let cfg = format!("{}\0", config);
    let mut err = [0 as c_char; 256];
    let mut args = LoomInitArgs {
        abi_version: 1,
        size: std::mem::size_of::<LoomInitArgs>() as u32,
        host: &HOST,
        queue: &*queue as *const MockQueue as *mut Queue,
        config: cfg.as_ptr() as *const c_char,
        config_len: config.len(),
        threads,
        worker: 7,
        instance: ptr::null_mut(),
        err: err.as_mut_ptr(),
        err_size: err.len(),
    };
    let rc = unsafe { loom_offload::__start(&mut args, ctor) };
    if rc != 0 {
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        return Err(msg.to_string_lossy().into_owned());
    }
    assert!(!args.instance.is_null());
    let (tx, rx) = channel();
    Ok(Harness {
        queue,
        instance: args.instance,
        tx,
        rx,
        next: 0,
    })
}

impl Harness {
    fn post(&mut self, req: &[u8]) -> usize {
        self.post_task(req).0
    }

    fn post_task(&mut self, req: &[u8]) -> (usize, *const MockTask) {
        let mut r = req.to_vec();
        r.push(0);
        self.next += 1;
        let t = Box::new(MockTask {
            id: self.next,
            req: r,
            cancelled: AtomicBool::new(false),
            done: self.tx.clone(),
        });
        let p = &*t as *const MockTask;
        self.queue.tasks.lock().unwrap().0.push_back(t);
        self.queue.cond.notify_one();
        (self.next, p)
    }

    fn call(&mut self, req: &[u8]) -> (c_int, Vec<u8>) {
        let id = self.post(req);
        let (got, status, rsp) =
            self.rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(got, id);
        (status, rsp)
    }

    fn close(self) -> Vec<String> {
        {
            let mut g = self.queue.tasks.lock().unwrap();
            g.1 = true;
        }
        self.queue.cond.notify_all();
        unsafe { loom_offload::__stop(self.instance) };
        let logs = self.queue.logs.lock().unwrap().clone();
        logs
    }
}

struct Counter {
    calls: AtomicUsize,
    stopped: Arc<AtomicUsize>,
}

thread_local! {
    // Constructors run on the thread calling init: each test counts the
    // shutdowns of its own runtime.
    static STOPPED: Arc<AtomicUsize> = Arc::new(AtomicUsize::new(0));
}

impl Handler for Counter {
    fn handle(&self, call: &Call<'_>) -> Result<Vec<u8>, Error> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        match call.payload() {
            b"panic" => panic!("boom {}", n),
            b"error" => Err(Error::new("bad input")),
            b"count" => Ok(n.to_string().into_bytes()),
            b"wait-cancel" => {
                for _ in 0..500 {
                    if call.is_cancelled() {
                        return Ok(b"saw cancel".to_vec());
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Ok(b"no cancel".to_vec())
            }
            p => {
                let mut v = b"echo:".to_vec();
                v.extend_from_slice(p);
                Ok(v)
            }
        }
    }

    fn shutdown(&self) {
        self.stopped.fetch_add(1, Ordering::SeqCst);
    }
}

fn counter(_cfg: &Config) -> Result<Counter, Error> {
    Ok(Counter {
        calls: AtomicUsize::new(0),
        stopped: STOPPED.with(|s| s.clone()),
    })
}

#[test]
fn results_errors_panics_and_state() {
    let mut h = start("", 2, counter).unwrap();
    assert_eq!(
        h.call(b"hello"),
        (sys::LOOM_OFFLOAD_OK, b"echo:hello".to_vec())
    );
    assert_eq!(h.call(b""), (sys::LOOM_OFFLOAD_OK, b"echo:".to_vec()));
    assert_eq!(
        h.call(b"error"),
        (sys::LOOM_OFFLOAD_ERROR, b"bad input".to_vec())
    );
    let (status, msg) = h.call(b"panic");
    assert_eq!(status, sys::LOOM_OFFLOAD_ERROR);
    let msg = String::from_utf8(msg).unwrap();
    assert!(msg.starts_with("panicked at tests/engine.rs:"), "{}", msg);
    assert!(msg.ends_with(": boom 4"), "{}", msg);
    // state survives the panic: the counter went on
    assert_eq!(h.call(b"count"), (sys::LOOM_OFFLOAD_OK, b"5".to_vec()));
    assert_eq!(STOPPED.with(|s| s.load(Ordering::SeqCst)), 0);
    // the panic, and only the panic (not the returned error), was logged
    let logs = h.close();
    assert_eq!(logs.len(), 1, "{:?}", logs);
    assert!(
        logs[0].starts_with("rust handler engine::Counter panicked at "),
        "{:?}",
        logs
    );
    assert!(logs[0].ends_with(": boom 4"), "{:?}", logs);
    assert_eq!(STOPPED.with(|s| s.load(Ordering::SeqCst)), 1);
}

#[test]
fn cancellation_is_visible() {
    let mut h = start("", 1, counter).unwrap();
    let (id, t) = h.post_task(b"wait-cancel");
    std::thread::sleep(Duration::from_millis(20));
    unsafe { (*t).cancelled.store(true, Ordering::SeqCst) };
    let (got, status, rsp) = h.rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (got, status, rsp),
        (id, sys::LOOM_OFFLOAD_OK, b"saw cancel".to_vec())
    );
    h.close();
}

#[test]
fn many_tasks_answered_exactly_once() {
    let mut h = start("", 4, counter).unwrap();
    let n = 2000;
    for i in 0..n {
        h.post(format!("t{}", i).as_bytes());
    }
    let mut seen = vec![false; n + 1];
    for _ in 0..n {
        let (id, status, rsp) =
            h.rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(status, sys::LOOM_OFFLOAD_OK);
        assert_eq!(rsp, format!("echo:t{}", id - 1).into_bytes());
        assert!(!seen[id], "task {} answered twice", id);
        seen[id] = true;
    }
    assert!(h.rx.recv_timeout(Duration::from_millis(50)).is_err());
    h.close();
}

#[test]
fn config_is_passed() {
    fn ctor(cfg: &Config) -> Result<Counter, Error> {
        assert_eq!(cfg.as_str(), "size=3 mode=fast");
        assert_eq!(cfg.get("mode"), Some("fast"));
        assert_eq!(cfg.get("size"), Some("3"));
        assert_eq!(cfg.get("nope"), None);
        assert_eq!(cfg.threads(), 3);
        assert_eq!(cfg.worker(), 7);
        counter(cfg)
    }
    let mut h = start("size=3 mode=fast", 3, ctor).unwrap();
    assert_eq!(h.call(b"x").0, sys::LOOM_OFFLOAD_OK);
    h.close();
}

#[test]
fn failing_or_panicking_constructor_is_reported() {
    fn fails(_: &Config) -> Result<Counter, Error> {
        Err(Error::new("no database"))
    }
    fn panics(_: &Config) -> Result<Counter, Error> {
        panic!("ctor exploded")
    }
    assert_eq!(
        start("", 1, fails).err().unwrap(),
        "failed to create handler: no database"
    );
    let e = start("", 1, panics).err().unwrap();
    assert!(
        e.starts_with("failed to create handler: panicked at "),
        "{}",
        e
    );
    assert!(e.ends_with("ctor exploded"), "{}", e);
}

struct Into;

impl Handler for Into {
    fn handle(&self, _call: &Call<'_>) -> Result<Vec<u8>, Error> {
        unreachable!("the runtime calls handle_into")
    }

    fn handle_into(
        &self,
        call: &Call<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        // the buffer is handed over empty, whatever the last call left
        assert!(out.is_empty());
        out.extend_from_slice(b"into:");
        out.extend_from_slice(call.payload());
        if call.payload() == b"fail" {
            return Err(Error::new("failed after writing"));
        }
        Ok(())
    }
}

#[test]
fn handle_into_reuses_one_buffer() {
    fn ctor(_: &Config) -> Result<Into, Error> {
        Ok(Into)
    }
    let mut h = start("", 1, ctor).unwrap();
    assert_eq!(h.call(b"a"), (sys::LOOM_OFFLOAD_OK, b"into:a".to_vec()));
    assert_eq!(
        h.call(b"fail"),
        (sys::LOOM_OFFLOAD_ERROR, b"failed after writing".to_vec())
    );
    let big = vec![b'z'; 3 << 20];
    let (status, rsp) = h.call(&big);
    assert_eq!((status, rsp.len()), (sys::LOOM_OFFLOAD_OK, 5 + (3 << 20)));
    assert_eq!(h.call(b"b"), (sys::LOOM_OFFLOAD_OK, b"into:b".to_vec()));
    h.close();
}
