-- The gateway's use of resty.loom.timer: the cross-worker statistics
-- collector, and two housekeeping timers of the kind a gateway runs.

local timer = require "resty.loom.timer"

local _M = {}

-- per-worker figures the housekeeping jobs maintain
local state = { heartbeats = 0, sweeps = 0 }


local function heartbeat(premature)
    if premature then
        return
    end
    state.heartbeats = state.heartbeats + 1
end


local function sweep(premature)
    if premature then
        return
    end
    -- stands for a cache sweep: a little CPU work every few seconds
    local n = 0
    for i = 1, 10000 do
        n = n + i % 7
    end
    state.sweeps = state.sweeps + 1
    return n
end


function _M.init()
    timer.configure({ resolution = 0.01 })
    local ok, err = timer.register_collector()
    if not ok then
        ngx.log(ngx.NOTICE, "[gateway] timer stats from this worker only: ",
                err)
    end
end


function _M.init_worker()
    local ok, err = timer.every({ interval = 1, name = "gateway.heartbeat" },
                                heartbeat)
    if not ok then
        ngx.log(ngx.ERR, "[gateway] failed to start the heartbeat: ", err)
    end
    -- spread the sweeps of the workers over the first 2 s
    ok, err = timer.every({ interval = 5, name = "gateway.sweep",
                            jitter = 2, mode = "fixed_delay" }, sweep)
    if not ok then
        ngx.log(ngx.ERR, "[gateway] failed to start the sweep: ", err)
    end
end


function _M.state()
    return state
end


return _M
