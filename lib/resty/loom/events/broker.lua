-- The broker side of the bus: runs in one worker, serves each worker's
-- connection (one request on the `listen unix:` server each; its own
-- worker's client is linked in-process), and forwards events to
-- per-worker queues. A publisher's events are acknowledged once they have
-- been written to every connected target's socket (or taken by the broker
-- worker's handler queue), so the publisher can re-send what was not
-- acknowledged after a broker crash. Queues are keyed by worker id and
-- outlive connections, so a restarting worker gets what was published
-- while it was down.
--
-- Its parts, in broker_*.lua: queue (state, queues, counters), route
-- (fan-out), writer, acks, reader, lane, stats. This file serves a
-- connection: the handshake, attaching it to its worker's queue, and the
-- broker worker's own in-process link.


local ffi = require "ffi"
local buffer = require "string.buffer"
local frame = require "resty.loom.events.frame"
local fifo = require "resty.loom.events.fifo"
local bqueue = require "resty.loom.events.broker_queue"
local acks = require "resty.loom.events.broker_acks"
local bwriter = require "resty.loom.events.broker_writer"
local route = require "resty.loom.events.broker_route"
local breader = require "resty.loom.events.broker_reader"
local lane = require "resty.loom.events.broker_lane"
local bstats = require "resty.loom.events.broker_stats"

local C = ffi.C
local ngx = ngx
local ngx_log = ngx.log
local ngx_var = ngx.var
local ngx_exit = ngx.exit
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local buf_new = buffer.new
local pcall = pcall
local tostring = tostring

local ERR = ngx.ERR
local WARN = ngx.WARN
local INFO = ngx.INFO

local T_HELLO = frame.HELLO
local T_WELCOME = frame.WELCOME
local T_REJECT = frame.REJECT
local FRAME_SIZE = frame.FRAME_SIZE
local AGENT = frame.AGENT
local READ_SIZE = frame.READ_SIZE
local HELLO_TIMEOUT = breader.HELLO_TIMEOUT

local state = bqueue.state
local queue = bqueue.queue
local count = bqueue.count
local drop = bqueue.drop
local send_acks = acks.send_acks
local connected = acks.connected
local writer = bwriter.writer
local release = bwriter.release
local consume = breader.consume
local reader = breader.reader
local serve_lane = lane.serve_lane


ffi.cdef [[
int ngx_loom_ffi_is_sibling(int pid);
unsigned int geteuid(void);
]]


local _M = { _VERSION = "0.2.0" }


local function log(level, ...)
    ngx_log(level, "[loom.events] ", ...)
end


local function reject(b, sock, reason, detail)
    count(b.stats.rejected, reason)
    -- during a reload, the new generation knocks on the old broker's door
    -- until it exits: expected, not worth a warning
    log(reason == "other generation" and INFO or WARN,
        "rejected a connection: ", reason, detail and (": " .. detail)
        or "")
    if sock then
        local out = buf_new()
        frame.put_control(out, T_REJECT, 0, reason)
        sock:send(out:get())
    end
end


local function read_hello(sock)
    sock:settimeout(HELLO_TIMEOUT * 1000)
    local hdr, err = sock:receive(FRAME_SIZE)
    if not hdr then
        return nil, "no hello: " .. err
    end
    local rbuf = buf_new()
    rbuf:put(hdr)
    local h = ffi.cast("loom_ev_frame_t *", (rbuf:ref()))
    if h.version ~= frame.VERSION then
        return nil, "wrong version"
    end
    if h.type ~= T_HELLO then
        return nil, "first frame is not a hello"
    end
    if h.len > 4096 then
        return nil, "hello too large"
    end
    local len = h.len
    local rest
    rest, err = sock:receive(len + frame.TRAILER_SIZE)
    if not rest then
        return nil, "no hello: " .. err
    end
    rbuf:put(rest)
    local hd, p = frame.peek(rbuf, 4096)
    if not hd then
        return nil, "bad hello"
    end
    local ok, hello = pcall(frame.decode_control, p, len)
    if not ok or type(hello) ~= "table" then
        return nil, "bad hello"
    end
    return hello
end


-- c takes q over: the connection that held it (a process with this id
-- that is gone, or lost its connection) is closed
local function attach(b, q, c)
    if q.conn then
        q.conn.closed = true
        q.data_sema:post(1)
    end
    q.conn = c
    q.gone = false
    connected(b, q.wid)
    if c.sock then
        b.remote = b.remote + 1
    end
    b.stats.accepted = b.stats.accepted + 1
    b.stats.connections = b.stats.connections + 1
end


local function detach(b, q, c)
    if q.conn == c then
        q.conn = nil
        -- (a replaced connection's writer may still be sending: its batch
        -- stays in flight until release())
        if not q.writer or q.writer == c then
            q.inflight_bidx = nil
            q.send_since = nil
        end
        if c.bye and not q.writer then
            -- its worker is exiting: what it did not confirm, and what
            -- comes for it from now on, is dropped and counted, not kept
            -- for a successor that this generation will not start
            q.gone = true
            if q.n > 0 then
                drop(b, q, "worker gone", q.n)
            end
            q.buf:reset()
            q.n, q.first_bidx = 0, nil
        end
    end
    if c.sock then
        b.remote = b.remote - 1
    end
    b.stats.connections = b.stats.connections - 1
    send_acks(b)
end


-- Serves one worker's connection; called from content_by_lua on the bus's
-- `listen unix:` server. Returns when the connection ends.
function _M.serve(bus)
    local b = state(bus)
    local opts = bus.opts

    if ngx.worker.id() ~= opts.broker then
        count(b.stats.rejected, "not the broker")
        log(ERR, "connection on worker ", ngx.worker.id(),
            " which is not the broker (", opts.broker, ")")
        return ngx_exit(444)
    end

    -- who is at the other end: same user, a worker of this master
    local uid = tonumber(ngx_var.loom_peer_uid)
    local pid = tonumber(ngx_var.loom_peer_pid)
    if not uid or uid ~= C.geteuid() then
        reject(b, nil, "peer uid", tostring(uid))
        return ngx_exit(444)
    end
    if not pid or C.ngx_loom_ffi_is_sibling(pid) ~= 1 then
        reject(b, nil, "peer not a worker", tostring(pid))
        return ngx_exit(444)
    end

    if ngx.req.get_headers()["upgrade"] ~= "loom-events/1" then
        reject(b, nil, "bad upgrade")
        return ngx_exit(400)
    end

    ngx.status = 101
    ngx.header["Upgrade"] = "loom-events/1"
    ngx.header["Content-Type"] = nil
    ngx.send_headers()
    ngx.flush(true)

    local sock, err = ngx.req.socket(true)
    if not sock then
        log(ERR, "failed to take the raw socket: ", err)
        return ngx_exit(444)
    end

    local hello
    hello, err = read_hello(sock)
    if not hello then
        reject(b, nil, err == "wrong version" and err or "bad hello", err)
        return ngx_exit(444)
    end

    local wid = hello.worker
    if hello.version ~= frame.VERSION then
        reject(b, sock, "wrong version", tostring(hello.version))
        return ngx_exit(444)
    end
    if hello.generation ~= bus.generation then
        reject(b, sock, "other generation")
        return ngx_exit(444)
    end
    if hello.pid ~= pid then
        reject(b, sock, "hello pid differs from peer", tostring(hello.pid))
        return ngx_exit(444)
    end
    if type(wid) ~= "number"
       or not ((wid >= 0 and wid < bus.worker_count)
               or (wid == AGENT and opts.privileged_agent)) then
        reject(b, sock, "bad worker id", tostring(wid))
        return ngx_exit(444)
    end

    local q = queue(b, wid)
    -- (the broker worker's own client is linked in-process: its id never
    -- comes over a socket, whatever the pid)
    if wid == opts.broker
       or (q.conn and q.conn.pid ~= pid
           and C.ngx_loom_ffi_is_sibling(q.conn.pid) == 1) then
        reject(b, sock, "worker id in use", tostring(wid))
        return ngx_exit(444)
    end
    if hello.lane then
        if not (q.conn and q.conn.pid == pid) then
            reject(b, sock, "lane without a connection", tostring(wid))
            return ngx_exit(444)
        end
        return serve_lane(bus, b, q, sock, pid)
    end
    local c = {
        sock = sock,
        wid = wid,
        pid = pid,
        q = q,
        rbuf = buf_new(READ_SIZE),
        ackq = fifo.new(),
        ctl = buf_new(256),     -- acks and pongs, sent ahead of events
        sent = 0,               -- events written on this connection
        closed = false,
    }
    attach(b, q, c)

    -- the welcome goes first, before anything queued for this worker
    local out = buf_new()
    frame.put_control(out, T_WELCOME, 0, { broker_pid = ngx.worker.pid() })
    local ok
    ok, err = sock:send(out:get())
    if not ok then
        log(INFO, "worker ", wid, " went away during the handshake: ", err)
    else
        log(INFO, "worker ", wid, " (pid ", pid, ") connected")
        local wt = spawn(writer, b, q, c)
        local rok, rerr = reader(bus, b, c)
        c.bye = rok == true
        c.closed = true
        q.data_sema:post(1)
        -- a writer stuck in a send to a dead peer is stopped here; what
        -- it had not written goes to the next connection
        kill(wt)
        release(q, c)
        if not rok and not ngx.worker.exiting() then
            if rerr == "closed" or rerr == "replaced" then
                log(INFO, "worker ", wid, " disconnected")
            else
                count(b.stats.rejected, "protocol error")
                log(WARN, "closed worker ", wid, "'s connection: ", rerr)
            end
        end
    end

    detach(b, q, c)
    return ngx_exit(444)
end


-- The broker worker's own link: no socket, no acks. deliver(buf) hands
-- the whole frames in buf to this worker's handlers and returns true, or
-- nil and an error; urgent(p, len) handles an urgent event's payload;
-- own(seq, run) says whether this worker's unique event seq, which lands
-- on it, runs. Starts the writer in the caller's context; returns the
-- link for take_local() and detach_local().
function _M.attach_local(bus, deliver, urgent, own)
    local b = state(bus)
    local wid = ngx.worker.id()
    local q = queue(b, wid)
    local c = {
        wid = wid,
        pid = ngx.worker.pid(),
        q = q,
        ctl = buf_new(64),      -- stays empty: no pings, no acks
        spare = buf_new(65536),
        deliver = deliver,
        urgent = urgent,
        own = own,
        closed = false,
    }
    attach(b, q, c)
    c.thread = spawn(writer, b, q, c)
    return c
end


-- Forwards the events in buf (whole frames, as the client writer makes
-- them) from this worker; may wait for a slow worker's queue. Returns
-- true, or nil and an error.
function _M.take_local(bus, c, buf)
    local b = bus.broker_state
    local need, err = consume(bus, b, c, buf)
    if not need then
        return nil, err
    end
    send_acks(b)
    return true
end


function _M.detach_local(bus, c)
    local b = bus.broker_state
    local q = c.q
    -- (only at exit)
    c.bye = true
    c.closed = true
    q.data_sema:post(1)
    ngx.thread.wait(c.thread)
    detach(b, q, c)
end


-- (the worker a unique key goes to: its publisher knows too)
_M.unique_target = route.unique_target
_M.count_left = bstats.count_left
_M.peers = bstats.peers
_M.stats = bstats.stats


return _M
