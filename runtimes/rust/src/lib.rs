//! Write resty-loom offload runtimes in safe Rust.
//!
//! A runtime is a shared object that `resty.loom.offload` loads into every
//! nginx worker (`offload.load("/path/libfoo.so", config, opts)`). This
//! crate implements the C ABI of `include/loom_offload.h` and gives you a
//! safe surface instead:
//!
//! * implement [`Handler`] for a type that holds your state (a cache, a
//!   connection pool, ...); it is shared by all runtime threads, so it must
//!   be `Send + Sync`;
//! * export it with [`export_runtime!`], naming a constructor
//!   `fn(&Config) -> Result<H, Error>`; the constructor runs on a runtime
//!   thread, never on the nginx event loop, so it may be slow;
//! * a handler returns `Ok(bytes)` (the Lua caller gets them) or
//!   `Err(error)` (the caller gets `nil, "runtime error: <message>"`);
//!   a panic is caught and reported the same way, with its location, and
//!   the thread goes on serving the next call; the panic is also written
//!   to nginx's error log once ("rust handler <type> panicked at ...").
//!
//! ```no_run
//! use loom_offload::{export_runtime, Call, Config, Error, Handler};
//!
//! struct Upper;
//!
//! impl Handler for Upper {
//!     fn handle(&self, call: &Call) -> Result<Vec<u8>, Error> {
//!         Ok(call.payload().to_ascii_uppercase())
//!     }
//! }
//!
//! fn new(_cfg: &Config) -> Result<Upper, Error> {
//!     Ok(Upper)
//! }
//!
//! export_runtime!(Upper, new);
//! ```

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

#[doc(hidden)]
pub mod sys;

mod engine;

#[doc(hidden)]
pub use engine::{start as __start, stop as __stop};

/// The error a handler returns; the Lua caller sees
/// `nil, "runtime error: " .. message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    msg: String,
}

impl Error {
    pub fn new(msg: impl Into<String>) -> Error {
        Error { msg: msg.into() }
    }

    pub fn message(&self) -> &str {
        &self.msg
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

impl From<String> for Error {
    fn from(msg: String) -> Error {
        Error { msg }
    }
}

impl From<&str> for Error {
    fn from(msg: &str) -> Error {
        Error {
            msg: msg.to_owned(),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error { msg: e.to_string() }
    }
}

impl From<std::str::Utf8Error> for Error {
    fn from(e: std::str::Utf8Error) -> Error {
        Error { msg: e.to_string() }
    }
}

/// What the runtime was loaded with: the configuration string given to
/// `offload.load()`, the number of runtime threads and the worker id.
#[derive(Debug, Clone)]
pub struct Config {
    text: String,
    threads: usize,
    worker: i32,
}

impl Config {
    #[doc(hidden)]
    pub fn new(text: String, threads: usize, worker: i32) -> Config {
        Config {
            text,
            threads,
            worker,
        }
    }

    /// The configuration string as given to `offload.load()` ("" if none).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value of `key` in a configuration written as
    /// `key=value` pairs separated by spaces, commas or semicolons.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.text
            .split([' ', ',', ';', '\t', '\n'])
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.trim())
    }

    /// How many threads serve calls.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The nginx worker id (`ngx.worker.id()`), -1 outside a worker.
    pub fn worker(&self) -> i32 {
        self.worker
    }
}

/// One call: the request bytes and a way to ask whether the caller gave
/// up (timeout, aborted request, worker shutting down).
pub struct Call<'a> {
    payload: &'a [u8],
    cancelled: &'a dyn Fn() -> bool,
    thread: usize,
}

impl<'a> Call<'a> {
    #[doc(hidden)]
    pub fn new(
        payload: &'a [u8],
        cancelled: &'a dyn Fn() -> bool,
        thread: usize,
    ) -> Call<'a> {
        Call {
            payload,
            cancelled,
            thread,
        }
    }

    /// The request bytes (valid for the duration of the call).
    pub fn payload(&self) -> &[u8] {
        self.payload
    }

    /// True once nobody waits for the answer any more; long handlers
    /// should check it now and then and give up early.
    pub fn is_cancelled(&self) -> bool {
        (self.cancelled)()
    }

    /// Index of the runtime thread serving this call, 0 .. threads-1.
    pub fn thread_index(&self) -> usize {
        self.thread
    }
}

/// A runtime: one value per nginx worker, shared by its threads.
pub trait Handler: Send + Sync + 'static {
    /// Serves one call.
    fn handle(&self, call: &Call<'_>) -> Result<Vec<u8>, Error>;

    /// Serves one call into `out`, an empty buffer the thread reuses from
    /// call to call (no allocation per call once it is big enough). The
    /// runtime always calls this one; the default calls `handle`.
    fn handle_into(
        &self,
        call: &Call<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        *out = self.handle(call)?;
        Ok(())
    }

    /// Called once when the runtime stops (worker exit or reload), after
    /// the last call this thread served; the default does nothing.
    fn shutdown(&self) {}
}

thread_local! {
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
    static PANIC_LOCATION: RefCell<Option<String>> = const {
        RefCell::new(None)
    };
}

static HOOK: Once = Once::new();

/// Panics inside handlers are reported to the caller, not printed to
/// nginx's stderr; other panics keep the hook that was installed before.
fn install_panic_hook() {
    HOOK.call_once(|| {
        let prev = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if IN_HANDLER.with(|h| h.get()) {
                let loc = info.location().map(|l| {
                    format!("{}:{}:{}", l.file(), l.line(), l.column())
                });
                PANIC_LOCATION.with(|p| *p.borrow_mut() = loc);
            } else {
                prev(info);
            }
        }));
    });
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Runs `f`, turning a panic into an error "panicked at <file:line>:
/// <message>".
pub fn catch<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    catch_panic(f).unwrap_or_else(Err)
}

/// Runs `f`; a panic becomes the outer `Err`, with the message `catch()`
/// gives, so that callers can tell a panic from a returned error.
pub(crate) fn catch_panic<T>(
    f: impl FnOnce() -> Result<T, Error>,
) -> Result<Result<T, Error>, Error> {
    install_panic_hook();
    let outer = IN_HANDLER.with(|h| h.replace(true));
    let res = panic::catch_unwind(AssertUnwindSafe(f));
    IN_HANDLER.with(|h| h.set(outer));
    match res {
        Ok(r) => Ok(r),
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            let loc = PANIC_LOCATION.with(|p| p.borrow_mut().take());
            // Dropping the payload could itself panic; keep it alive.
            std::mem::forget(payload);
            Err(Error::new(match loc {
                Some(loc) => format!("panicked at {}: {}", loc, msg),
                None => format!("panicked: {}", msg),
            }))
        }
    }
}

/// Exports the C entry points of include/loom_offload.h for a handler
/// type built by `ctor: fn(&Config) -> Result<H, Error>`. Use it once per
/// `cdylib`.
#[macro_export]
macro_rules! export_runtime {
    ($handler:ty, $ctor:expr) => {
        /// Entry point of include/loom_offload.h.
        ///
        /// # Safety
        /// Called by the host only.
        #[no_mangle]
        pub unsafe extern "C" fn loom_offload_init(
            args: *mut $crate::sys::LoomInitArgs,
        ) -> ::std::os::raw::c_int {
            let ctor: fn(
                &$crate::Config,
            )
                -> ::std::result::Result<$handler, $crate::Error> = $ctor;
            $crate::__start(args, ctor)
        }

        /// Entry point of include/loom_offload.h.
        ///
        /// # Safety
        /// Called by the host only, once per instance.
        #[no_mangle]
        pub unsafe extern "C" fn loom_offload_shutdown(
            instance: *mut ::std::os::raw::c_void,
        ) {
            $crate::__stop(instance)
        }
    };
}
