-- A plain-LuaJIT harness of resty.loom.publish's per-message path, for
-- callgrind (instruction counts) and os.clock timings outside nginx:
-- send() into the buffer, take() of each full batch into a request body,
-- and the success path of each batch (the sender's acknowledgement work).
-- nginx's own parts (cosockets, timers, semaphores) are stubs; without
-- nginx the C helpers are absent, so base64 and the JSON check run in Lua.
--
--   luajit bench/publish/harness.lua STAGE N
--   STAGE: none (setup only), send, take (send + take), full (send, take,
--   acknowledgements through landed()/settle(), with on_success)
--
--   valgrind --tool=callgrind luajit bench/publish/harness.lua full 200000
--   (minus the same with N = 0: instructions per message)
--
-- LOOM_HELPERS=<path of a .so>: src/ngx_loom_base64.c and ngx_loom_json.c
-- built as a plain shared library (with a stub ngx_loom.h), loaded into
-- the FFI's global namespace so that the publisher uses them as in nginx

local stage = arg[1] or "full"
local N = tonumber(arg[2] or "100000")

package.path = "lib/?.lua;" .. package.path

if os.getenv("LOOM_HELPERS") then
    require("ffi").load(os.getenv("LOOM_HELPERS"), true)
end

local now = 1000
ngx = {                                                 -- luacheck: ignore
    now = function() return now end,
    update_time = function() end,
    log = function() end,
    ERR = 4, WARN = 5, NOTICE = 6, INFO = 7, DEBUG = 8,
    sleep = function() end,
    timer = { at = function() return true end },
    thread = {},
    worker = { exiting = function() return false end,
               id = function() return 0 end, pid = function() return 1 end },
    get_phase = function() return "init" end,
    decode_base64 = function(s) return s end,
    encode_base64 = function(s) return s end,
    config = { subsystem = "http" },
}
package.preload["ngx.semaphore"] = function()
    local mt = { __index = {
        count = function() return 0 end, post = function() end,
        wait = function() return true end } }
    return { new = function() return setmetatable({}, mt) end }
end
package.preload["resty.loom.http"] = function()
    return {
        parse_url = function() return "http", "127.0.0.1", 8085 end,
        new = function() return { connects = 0 } end,
    }
end
package.preload["resty.loom.publish.auth"] = function()
    return {
        check = function() end,
        new = function() return { kind = "none" } end,
    }
end
package.preload["resty.loom.publish.spoolfile"] = function()
    return { release = function() end }
end
package.preload["resty.loom.publish.spool"] = function()
    return { put = function() end, done = function() end,
             feed = function() end, keep = function() end }
end
package.preload["resty.loom.publish.shutdown"] = function()
    return { add = function() end, abandon = function() end }
end
package.preload["resty.loom.publish.stats"] = function()
    return { register_collector = function() end }
end
package.preload["resty.loom.publish.sender"] = function()
    return { start = function(self) self.running = true return true end }
end

local publish = require "resty.loom.publish"
io.stderr:write("C base64: ", tostring(require(
    "resty.loom.publish.base64").native), "\n")
local buffer = require "resty.loom.publish.buffer"
local report = require "resty.loom.publish.report"
local cjson = require "cjson.safe"

local acked = 0
local p = publish.new({
    project = "bench-proj", topic = "bench-topic",
    emulator_host = "127.0.0.1:8085",
    buffer_max_messages = 1e9, buffer_max_bytes = 1e12,
    on_success = function(ids) acked = acked + #ids end,
})

-- what the fast sink answers for a batch of n messages
local acks = {}
local function ack_body(n)
    local a = acks[n]
    if not a then
        local t = {}
        for i = 1, n do
            t[i] = '"' .. (1000000 + i) .. '"'
        end
        a = '{"messageIds":[' .. table.concat(t, ",") .. ']}'
        acks[n] = a
    end
    return a
end

-- the sender's work for one batch that was acknowledged (sender.lua's
-- dispatch() without the request)
local function send_batch(b)
    local q, bytes = b.q, b.bytes
    local body = buffer.take(p, b)
    buffer.landed(p, b)
    if stage ~= "take" then
        p.sent = p.sent + b.n
        local hist, times = p.latency, b.times
        for i = b.head, b.total do
            hist:record(now - times[i])
        end
        local t = cjson.decode(ack_body(b.n))
        report.call(p, p.on_success, t.messageIds, { topic = p.topic,
                    attempts = 1 })
    end
    buffer.settle(p, q, bytes)
    return #body
end

local data = string.rep("0123456789abcdef", 64)
local t0 = os.clock()
for i = 1, N do
    local attrs = { host = "edge-1", path = "/loom", seq = tostring(i) }
    if not p:send(data, attrs) then
        error("send failed")
    end
    if i % 1000 == 0 then
        now = now + 0.012
        if stage ~= "send" then
            local b = buffer.next_batch(p, now, false)
            while b do
                send_batch(b)
                b = buffer.next_batch(p, now, false)
            end
        end
    end
    if stage == "send" and i % 1000 == 0 then
        -- what was sent is dropped: the batches' buffers are reused
        local b = buffer.next_batch(p, now, false)
        while b do
            b.q.batches.first = b.q.batches.first + 1
            p.queued_messages = p.queued_messages - b.n
            p.queued_bytes = p.queued_bytes - b.bytes
            b.buf:reset()
            table.insert(p.free_bufs, b.buf)
            b = buffer.next_batch(p, now, false)
        end
    end
end
local el = os.clock() - t0
if N > 0 then
    io.stderr:write(string.format(
        "%s: %d messages, %.3f us per message, acked %d\n", stage, N,
        el * 1e6 / N, acked))
end
