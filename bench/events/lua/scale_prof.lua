-- LuaJIT's sampling profiler (jit.p) in the broker worker, for
-- bench/events/scale.py with SCALE_PROFILE: samples from `after` seconds
-- after the worker starts for `seconds` seconds, written to `out`.

local _M = {}


function _M.start(broker, mode, after, seconds, out)
    if ngx.worker.id() ~= broker then
        return
    end
    assert(ngx.timer.at(after, function(premature)
        if premature then
            return
        end
        local jp = require "jit.p"
        jp.start(mode, out)
        ngx.sleep(seconds)
        jp.stop()
    end))
end


return _M
