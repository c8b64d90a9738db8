-- The example gateway: every area of resty-loom present under
-- gateway/<area>.lua gets its init() and init_worker() called here, in this
-- order (events first: the others may publish through it).


local AREAS = { "events", "timer", "publish", "offload", "watchdog",
                "observe" }

local loaded = {}

local _M = { _VERSION = "0.2.0" }


function _M.init()
    for _, area in ipairs(AREAS) do
        local name = "gateway." .. area
        if package.searchpath(name, package.path) then
            local mod = require(name)
            loaded[#loaded + 1] = mod
            if mod.init then
                mod.init()
            end
        end
    end
end


function _M.init_worker()
    for _, mod in ipairs(loaded) do
        if mod.init_worker then
            mod.init_worker()
        end
    end
end


return _M
