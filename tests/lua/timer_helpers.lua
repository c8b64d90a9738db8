-- Helpers for tests/test_timer*.py (loaded in nginx as "timer_helpers").

local ffi = require "ffi"

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } loom_timer_timespec_t;
int loom_timer_clock_gettime(int clk, loom_timer_timespec_t *tp)
    __asm__("clock_gettime");
]])

local ts = ffi.new("loom_timer_timespec_t")

local _M = {}


-- monotonic seconds (the clock resty.loom.timer schedules against)
function _M.mono()
    ffi.C.loom_timer_clock_gettime(1, ts)
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) / 1e9
end


function _M.incr(key, by)
    local d = ngx.shared.t
    local v, err = d:incr(key, by or 1, 0)
    if not v then
        ngx.log(ngx.ERR, "incr ", key, ": ", err)
    end
    return v
end


-- records max(key) = v in the shared dict
function _M.max(key, v)
    local d = ngx.shared.t
    local cur = d:get(key)
    if not cur or v > cur then
        d:set(key, v)
    end
end


function _M.get(key)
    return ngx.shared.t:get(key)
end


-- the callback every test timer can use: counts runs and early fires
-- (a fire before created + delay, on the monotonic clock)
function _M.checked(premature, created, delay, tag)
    local now = _M.mono()
    if premature then
        _M.incr(tag .. ":premature")
        return
    end
    _M.incr(tag .. ":runs")
    -- 1 us slack: the clock we compare with is read in a different place
    if now < created + delay - 1e-6 then
        _M.incr(tag .. ":early")
    end
    _M.max(tag .. ":late_max", now - created - delay)
end


-- like checked(), and records how early the earliest fire was
function _M.early(premature, created, delay, tag)
    if premature then
        return
    end
    local early = created + delay - _M.mono()
    _M.incr(tag .. ":runs")
    if early > 1e-6 then
        _M.incr(tag .. ":early")
        _M.max(tag .. ":early_max", early)
    end
end


-- n timers through at (ngx.timer.at or resty.loom.timer.at), created
-- after the handler has run for busy_ms without nginx updating its
-- cached clock; delays of 1 to 100 ms
function _M.early_batch(at, tag, n, busy_ms)
    local deadline = _M.mono() + busy_ms / 1000
    while _M.mono() < deadline do end
    for i = 1, n do
        local d = (i % 100 + 1) / 1000
        assert(at(d, _M.early, _M.mono(), d, tag))
    end
end


return _M
