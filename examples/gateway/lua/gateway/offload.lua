-- The example gateway's offload runtime: the example C runtime
-- (runtimes/c/libloom_offload_c.so, built by `make runtimes`), loaded in
-- every worker. GET /offload/hash does SHA-256 rounds on its threads.


local offload = require "resty.loom.offload"

local MAX_ROUNDS = 1000000

local _M = {}

local rt
local load_err


-- the checkout's root, from where this file was found
local function root()
    local path = package.searchpath("gateway.offload", package.path) or ""
    return path:match("^(.*)/examples/gateway/lua/gateway/offload%.lua$")
           or "."
end


local reply = require("gateway.json").reply


function _M.init_worker()
    offload.register_collector()

    if not ngx.worker.id() then
        return      -- a helper process (the events agent): no runtime here
    end

    local err
    rt, err = offload.load(root() .. "/runtimes/c/libloom_offload_c.so", "",
                           { threads = 2, queue = 1024, timeout = 5 })
    if not rt then
        load_err = err
        ngx.log(ngx.WARN, "[gateway.offload] ", err)
    end
end


-- GET /offload/hash?data=<text>&rounds=<n>
function _M.hash()
    if not rt then
        return reply(503, { error = load_err or "offload runtime not loaded" })
    end

    local args = ngx.req.get_uri_args()
    local data = args.data
    if type(data) ~= "string" then
        data = ""
    end

    local rounds = tonumber(args.rounds) or 1
    if rounds < 1 or rounds > MAX_ROUNDS or rounds ~= math.floor(rounds) then
        return reply(400, { error = "rounds must be an integer in 1.."
                                    .. MAX_ROUNDS })
    end

    local res, err = rt:call("sha256 " .. rounds .. " " .. data)
    if not res then
        return reply(err == "queue full" and 503 or 502, { error = err })
    end

    reply(200, { sha256 = res, rounds = rounds, worker = ngx.worker.id() })
end


return _M
