//! Hand-written binding to include/loom_offload.h (ABI version 1).
//!
//! Mirrors the header's structures field by field; everything here is
//! `#[repr(C)]` and only used by the safe layer in `engine.rs`.

#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_uchar, c_uint, c_void};

pub const LOOM_OFFLOAD_ABI_VERSION: c_uint = 1;

pub const LOOM_OFFLOAD_TASK: c_int = 0;
pub const LOOM_OFFLOAD_TIMEDOUT: c_int = 1;
pub const LOOM_OFFLOAD_CLOSED: c_int = 2;

pub const LOOM_OFFLOAD_OK: c_int = 0;
pub const LOOM_OFFLOAD_ERROR: c_int = 1;

pub const LOOM_OFFLOAD_LOG_ERR: c_int = 4;
pub const LOOM_OFFLOAD_LOG_WARN: c_int = 5;
pub const LOOM_OFFLOAD_LOG_NOTICE: c_int = 6;
pub const LOOM_OFFLOAD_LOG_INFO: c_int = 7;
pub const LOOM_OFFLOAD_LOG_DEBUG: c_int = 8;

/// `loom_offload_queue_t` (opaque).
#[repr(C)]
pub struct Queue {
    _private: [u8; 0],
}

/// `loom_offload_task_t` (opaque).
#[repr(C)]
pub struct Task {
    _private: [u8; 0],
}

/// `loom_offload_host_t`: the host's function table.
#[repr(C)]
pub struct Host {
    pub abi_version: c_uint,
    pub size: c_uint,
    pub wait: unsafe extern "C" fn(
        queue: *mut Queue,
        timeout_ms: c_int,
        task: *mut *mut Task,
    ) -> c_int,
    pub request: unsafe extern "C" fn(
        task: *mut Task,
        len: *mut usize,
    ) -> *const c_uchar,
    pub cancelled: unsafe extern "C" fn(task: *mut Task) -> c_int,
    pub answer: unsafe extern "C" fn(
        task: *mut Task,
        status: c_int,
        data: *const c_void,
        len: usize,
    ) -> c_int,
    pub log: unsafe extern "C" fn(
        queue: *mut Queue,
        level: c_int,
        msg: *const c_char,
        len: usize,
    ),
}

/// `loom_offload_init_t`: what `loom_offload_init()` receives.
#[repr(C)]
pub struct LoomInitArgs {
    pub abi_version: c_uint,
    pub size: c_uint,
    pub host: *const Host,
    pub queue: *mut Queue,
    pub config: *const c_char,
    pub config_len: usize,
    pub threads: c_uint,
    pub worker: c_int,
    pub instance: *mut c_void,
    pub err: *mut c_char,
    pub err_size: usize,
}
