//! Example runtime: a per-worker cache plus a few operations the tests
//! and the benchmark use. Build with `make` (or
//! `cargo build --release --example loom_rt_rust_example`) and load
//! `runtimes/rust/build/libloom_rt_rust_example.so`.
//!
//! Configuration (`key=value`, separated by spaces):
//!   `mode=echo`   answer every call with its payload (the benchmark);
//!   otherwise the payload is `<op>:<argument>`:
//!
//!   echo:<x>        returns x
//!   hash:<x>        FNV-1a 64 of x, 16 hex digits, memoised in the cache
//!   put:<k>=<v>     stores v under k, returns "ok"
//!   get:<k>         the stored value, or "miss"
//!   count:          calls served by this worker's runtime so far
//!   sleep:<ms>      sleeps, stops early when the call is cancelled
//!   stuck:<ms>      sleeps without looking at cancellation
//!   panic:<msg>     panics with msg
//!   error:<msg>     returns an error
//!   big:<n>         n bytes of "x"

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use loom_offload::{export_runtime, Call, Config, Error, Handler};

struct Cache {
    echo_only: bool,
    calls: AtomicU64,
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
}

fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn number(arg: &[u8]) -> Result<u64, Error> {
    std::str::from_utf8(arg)?
        .parse::<u64>()
        .map_err(|e| Error::new(format!("bad number: {}", e)))
}

fn sleep(call: &Call<'_>, ms: u64, watch_cancel: bool) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_millis(ms);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return b"slept".to_vec();
        }
        if watch_cancel && call.is_cancelled() {
            return b"cancelled".to_vec();
        }
        thread::sleep((deadline - now).min(Duration::from_millis(2)));
    }
}

impl Cache {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Vec<u8>>> {
        // A panic elsewhere never leaves the map half-written, so a
        // poisoned lock is still usable.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Handler for Cache {
    // The echo benchmark's path: the answer goes into the thread's reused
    // buffer, no allocation per call.
    fn handle_into(
        &self,
        call: &Call<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Error> {
        if self.echo_only {
            self.calls.fetch_add(1, Ordering::Relaxed);
            out.extend_from_slice(call.payload());
            return Ok(());
        }
        *out = self.handle(call)?;
        Ok(())
    }

    fn handle(&self, call: &Call<'_>) -> Result<Vec<u8>, Error> {
        let payload = call.payload();
        let calls = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.echo_only {
            return Ok(payload.to_vec());
        }
        let (op, arg) = match payload.iter().position(|&b| b == b':') {
            Some(i) => (&payload[..i], &payload[i + 1..]),
            None => return Ok(payload.to_vec()),
        };
        match op {
            b"echo" => Ok(arg.to_vec()),
            b"hash" => {
                let mut key = b"hash:".to_vec();
                key.extend_from_slice(arg);
                if let Some(v) = self.map().get(&key) {
                    return Ok(v.clone());
                }
                let v = format!("{:016x}", fnv1a64(arg)).into_bytes();
                self.map().insert(key, v.clone());
                Ok(v)
            }
            b"put" => {
                let i =
                    arg.iter().position(|&b| b == b'=').unwrap_or(arg.len());
                let v = arg.get(i + 1..).unwrap_or(b"").to_vec();
                self.map().insert(arg[..i].to_vec(), v);
                Ok(b"ok".to_vec())
            }
            b"get" => Ok(self
                .map()
                .get(arg)
                .cloned()
                .unwrap_or_else(|| b"miss".to_vec())),
            b"count" => Ok(calls.to_string().into_bytes()),
            b"sleep" => Ok(sleep(call, number(arg)?, true)),
            b"stuck" => Ok(sleep(call, number(arg)?, false)),
            b"panic" => panic!("{}", String::from_utf8_lossy(arg)),
            b"error" => Err(Error::new(String::from_utf8_lossy(arg))),
            b"big" => Ok(vec![b'x'; number(arg)? as usize]),
            _ => Ok(payload.to_vec()),
        }
    }
}

fn new(cfg: &Config) -> Result<Cache, Error> {
    let echo_only = match cfg.get("mode") {
        None | Some("ops") => false,
        Some("echo") => true,
        Some(m) => return Err(Error::new(format!("unknown mode: {}", m))),
    };
    Ok(Cache {
        echo_only,
        calls: AtomicU64::new(0),
        map: Mutex::new(HashMap::new()),
    })
}

export_runtime!(Cache, new);
