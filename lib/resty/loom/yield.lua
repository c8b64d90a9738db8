-- resty.loom.yield: lets the event loop take a turn, then goes on.
--
-- Long loops in a timer or a request (a burst of events, a run of timer
-- callbacks) must pause now and then so that requests get in. ngx.sleep(0)
-- does not do that on a stock nginx: in a coroutine resumed by a timer it
-- is a 0 ms timer that nginx runs again in the same pass, without polling
-- (see src/ngx_loom_yield.c). yield() resumes the caller on the next turn
-- of the loop instead, after epoll and the due timers. Without our nginx
-- module (or on an nginx older than 1.17.5) it sleeps 1 ms, which lets the
-- loop turn too, at the cost of the wait.


local ffi = require "ffi"
local semaphore = require "ngx.semaphore"

local C = ffi.C
local ngx_sleep = ngx.sleep

local LOOM_FFI_OK = 0
-- longer than any turn of the loop: only a lost post would wait this long
local WAIT_MAX = 1


ffi.cdef [[
int ngx_loom_ffi_yield(void *sem);
]]


local native = pcall(function() return C.ngx_loom_ffi_yield end)
local sema          -- created in the worker, on first use


local _M = { _VERSION = "0.2.0" }


-- Yields to the event loop for one turn. Call it where ngx.sleep is
-- allowed (rewrite, access, content, timer and the ssl phases).
function _M.yield()
    if native then
        if not sema then
            sema = semaphore.new()
        end
        if C.ngx_loom_ffi_yield(sema.sem) == LOOM_FFI_OK then
            sema:wait(WAIT_MAX)
            return
        end
    end
    ngx_sleep(0.001)
end


return _M
