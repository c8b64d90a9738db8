-- Where timers come from: start() wraps ngx.timer.at/every so that the
-- report of a stalling timer names where it was made; the wrapper's frames
-- are dropped from the timer's backtrace.


local ngx = ngx
local debug_getinfo = debug.getinfo
local type = type
local str_byte = string.byte
local str_find = string.find
local str_sub = string.sub


local RUNNER_SOURCE = str_sub(debug_getinfo(1, "S").source, 2)


-- a frame of the code that runs timer callbacks: this module's ngx.timer
-- wrapper, resty.loom.timer, or the xpcall it calls callbacks with
local function is_runner(f)
    return f.source == RUNNER_SOURCE
           or str_find(f.source, "resty/loom/timer", 1, true) ~= nil
           or str_find(f.source, "[builtin#", 1, true) == 1
end


-- drops the runner's frames under a timer's callback (frames innermost
-- first); the callback has no name of its own. Without a site (a loom
-- timer made with stats = false) the callback frame stands for it.
local function drop_runner_frames(timer, frames)
    local n = #frames
    if n == 0 or not is_runner(frames[n]) then
        return
    end
    while n > 0 and is_runner(frames[n]) do
        frames[n] = nil
        n = n - 1
    end
    local cb = frames[n]
    if cb then
        cb.func = nil
        if not timer.callback then
            timer.callback = cb.source
        end
    end
end


-- the bottom frame of every timer made while the watchdog runs; the C side
-- reads its local loom_timer_site to tell where the timer was created
local function loom_timer_runner(premature, loom_timer_site, cb, ...)
    cb(premature, ...)
end


local function src_name(info)
    local src = info.source
    if str_byte(src, 1) == 64 then        -- "@path"
        return str_sub(src, 2)
    end
    return info.short_src
end


-- "<where ngx.timer.at was called>|<where the callback is defined>"
local function timer_site(cb)
    local info = debug_getinfo(3, "Sl")
    local def = debug_getinfo(cb, "S")
    local site = info and (src_name(info) .. ":" .. (info.currentline or 0))
                 or "?"
    return site .. "|" .. src_name(def) .. ":" .. def.linedefined
end


-- ngx.timer.at or every (as made by make) with the creation site noted
local function noting_site(make)
    return function(delay, cb, ...)
        if type(cb) ~= "function" then
            return make(delay, cb, ...)
        end
        return make(delay, loom_timer_runner, timer_site(cb), cb, ...)
    end
end


-- wraps what ngx.timer.at/every are now (native ones, or another
-- library's), except resty.loom.timer's after its patch(): those name
-- their timers themselves, and raise at their caller's line
local function wrap_timers()
    local timer = ngx.timer
    local loom = package.loaded["resty.loom.timer"]
    local patched = type(loom) == "table"
    -- luacheck: push ignore 122
    if not (patched and timer.at == loom.at) then
        timer.at = noting_site(timer.at)
    end
    if not (patched and timer.every == loom.every) then
        timer.every = noting_site(timer.every)
    end
    -- luacheck: pop
end


local _M = { _VERSION = "0.2.0" }


_M.drop_runner_frames = drop_runner_frames
_M.wrap = wrap_timers


return _M
