-- The names of the numbers the C side reports: ngx_lua phases, LuaJIT VM
-- states, x86_64 system calls and the errno values of a refused hardware
-- breakpoint.


local jit = require "jit"


local PHASES = {
    [0x0001] = "set", [0x0002] = "rewrite", [0x0004] = "access",
    [0x0008] = "content", [0x0010] = "log", [0x0020] = "header_filter",
    [0x0040] = "body_filter", [0x0080] = "timer", [0x0100] = "init_worker",
    [0x0200] = "balancer", [0x0400] = "ssl_cert",
    [0x0800] = "ssl_session_store", [0x1000] = "ssl_session_fetch",
    [0x2000] = "exit_worker", [0x4000] = "ssl_client_hello",
    [0x8000] = "server_rewrite",
}

local VMSTATES = { [78] = "compiled", [73] = "interpreted", [67] = "C",
                   [71] = "GC", [74] = "JIT compiler" }

-- x86_64 system call numbers of the calls that block a worker most often
local SYSCALLS = {
    [0] = "read", [1] = "write", [2] = "open", [3] = "close", [4] = "stat",
    [5] = "fstat", [6] = "lstat", [7] = "poll", [8] = "lseek", [9] = "mmap",
    [17] = "pread64", [18] = "pwrite64", [19] = "readv", [20] = "writev",
    [21] = "access", [23] = "select", [34] = "pause", [35] = "nanosleep",
    [42] = "connect", [43] = "accept", [44] = "sendto", [45] = "recvfrom",
    [46] = "sendmsg", [47] = "recvmsg", [56] = "clone", [57] = "fork",
    [58] = "vfork", [59] = "execve", [61] = "wait4", [72] = "fcntl",
    [73] = "flock", [74] = "fsync", [75] = "fdatasync", [76] = "truncate",
    [77] = "ftruncate", [82] = "rename", [83] = "mkdir", [87] = "unlink",
    [202] = "futex", [230] = "clock_nanosleep", [232] = "epoll_wait",
    [247] = "waitid", [257] = "openat", [270] = "pselect6", [271] = "ppoll",
    [281] = "epoll_pwait", [288] = "accept4", [435] = "clone3",
}
if jit.arch ~= "x64" then
    SYSCALLS = {}
end

local BP_ERRORS = { [1] = "EPERM", [2] = "ENOENT", [13] = "EACCES",
                    [19] = "ENODEV", [22] = "EINVAL", [28] = "ENOSPC",
                    [38] = "ENOSYS", [95] = "EOPNOTSUPP" }


local _M = { _VERSION = "0.2.0" }


_M.PHASES = PHASES
_M.VMSTATES = VMSTATES
_M.BP_ERRORS = BP_ERRORS


function _M.syscall_name(nr)
    return SYSCALLS[nr] or ("syscall " .. nr)
end


return _M
