-- The client's connection to the broker: the loop that connects (and
-- reconnects), the writer that sends the queued events and confirms what
-- was received, and the broker worker's link to the broker in its own
-- process.


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local frame = require "resty.loom.events.frame"
local fifo = require "resty.loom.events.fifo"
local broker = require "resty.loom.events.broker"
local receive = require "resty.loom.events.receive"
local own = require "resty.loom.events.own"
local collect = require "resty.loom.events.collect"
local lane_timer = require("resty.loom.events.lane").lane_timer
local handshake = require("resty.loom.events.handshake").handshake
local evlog = require "resty.loom.events.log"

local ngx = ngx
local ngx_now = ngx.now
local str_format = string.format
local ngx_sleep = ngx.sleep
local timer_at = ngx.timer.at
local spawn = ngx.thread.spawn
local kill = ngx.thread.kill
local worker_exiting = ngx.worker.exiting
local buf_new = buffer.new
local random = math.random
local min = math.min
local log = evlog.log
local warn_once = evlog.warn_once
local consume = receive.consume
local reader = receive.reader
local wait_inbox_room = receive.wait_inbox_room
local wake_publishers = receive.wake_publishers
local release_own = own.release_own
local own_unique = own.own_unique
local release_held = own.release_held
local receive_urgent = collect.receive_urgent

local ERR = ngx.ERR
local WARN = ngx.WARN
local UNREACHABLE_WARN = 1     -- seconds without the broker before a warning

local T_ACK = frame.ACK
local T_PING = frame.PING
local T_BYE = frame.BYE
local T_SHM = frame.SHM
local WRITE_MAX = frame.WRITE_MAX
local ACK_EVERY = receive.ACK_EVERY
local ACK_DELAY = receive.ACK_DELAY
local MORE = receive.MORE


local _M = { _VERSION = "0.2.0" }


-- a header-only control frame
local function control(typ, seq)
    local out = buf_new(64)
    frame.put_empty(out, typ, seq or 0)
    return out:get()
end


-- sends on the connection; a failure is kept on the link for the reader
local function send(sock, link, data)
    local ok, err = sock:send(data)
    if not ok then
        link.error = "failed to send: " .. err
    end
    return ok
end


-- Takes whole events from the front of unsent, up to WRITE_MAX bytes:
-- their frames or, when they can travel in our ring, one SHM frame for
-- them (see shm.lua). aq (the socket writer's unacked queue) gets
-- (seq, bytes) per event, bytes being what each keeps in unacked.
-- Returns the frames, the first and the last seq, and the bytes taken.
local function take(self, aq)
    local uq = self.unsent_q
    local first = uq:peek()
    -- the next event that cannot travel in the ring: a run stops before it
    -- (those before first were taken, or dropped by drop_oldest)
    local pq = self.plain_q
    pq:pop_below(first)
    local plain = pq:peek()
    local runs = self.ring_runs
    local _, keep = runs:peek()
    -- a run in the ring; or, first being such an event, the events of
    -- that kind in a row; or (no ring, or no room in it) all of them
    local via_ring, only_plain = false, false
    if self.has_ring then
        if first == plain then
            only_plain = true
        elseif self.rings:room(self.worker, WRITE_MAX, keep) then
            via_ring = true
        else
            -- (the broker still needs the runs there, a subscriber being
            -- behind, or we do: not acknowledged yet)
            self.counters.ring_full = self.counters.ring_full + 1
        end
    end
    local bytes, n = 0, 0
    -- (a run counts as its events in the bounds of the broker's queues)
    local max_run = self.opts.max_backlog
    local last = 0
    while true do
        local s, b = uq:peek()
        if not s or (bytes > 0 and bytes + b > WRITE_MAX)
           or (via_ring and (n == max_run or s == plain)) then
            break
        end
        if only_plain then
            if s ~= plain then
                break
            end
            pq:pop()
            plain = pq:peek()
        end
        uq:pop()
        if aq then
            if not via_ring then
                aq:push(s, b)
            elseif n > 0 then
                aq:push(last, 0)
            end
        end
        bytes, n, last = bytes + b, n + 1, s
    end
    if not via_ring then
        return self.unsent:get(bytes), first, last, bytes
    end
    local pos = self.rings:put(self.worker, self.unsent:ref(), bytes, n,
                               keep)
    self.unsent:skip(bytes)
    self.counters.ring_events = self.counters.ring_events + n
    local out = self.ring_out
    local size = frame.put_shm(out, last, self.worker, n, pos, bytes)
    if aq then
        aq:push(last, size)
        runs:push(last, pos)
    end
    return out:get(), first, last, bytes
end


local function writer(self, sock, link)
    local last_send = ngx_now()
    local hb = self.opts.heartbeat
    while true do
        if #self.unsent == 0 and (#self.urgent == 0 or self.lane) then
            if self.stopping then
                -- what we received goes confirmed: the broker counts
                -- the rest as dropped for us
                if not send(sock, link, control(T_ACK, link.got)
                                        .. control(T_BYE)) then
                    return nil, link.error
                end
                return true
            end
            self.writer_idle = true
            -- events received and not confirmed yet: soon, in one frame
            -- for all that come meanwhile
            link.short = link.got > link.acked
            self.wsema:wait(link.short and ACK_DELAY or hb / 2)
            self.writer_idle = false
        end
        if link.closed then
            return true
        end
        if #self.urgent > 0 and not self.lane then
            -- (without a lane: behind the write under way)
            if not send(sock, link, self.urgent:get()) then
                return nil, link.error
            end
            last_send = ngx_now()
        end
        local got = link.got
        if got > link.acked
           and (#self.unsent == 0 or got - link.acked >= ACK_EVERY
                or ngx_now() - (link.since or 0) >= ACK_DELAY) then
            -- the broker keeps what it wrote to us until we confirm it:
            -- when we have nothing else to send, after a long run, or
            -- ACK_DELAY after the first unconfirmed event (not with every
            -- write: a send each costs both sides)
            if not send(sock, link, control(T_ACK, got)) then
                return nil, link.error
            end
            link.acked = got
            link.since = got < link.got and ngx_now() or nil
            last_send = ngx_now()
        end
        if #self.unsent > 0 then
            -- whole events, up to WRITE_MAX bytes per write; they stay in
            -- unacked until the broker acknowledges them
            local data, first, last, bytes = take(self, self.unacked_q)
            -- (a run in our ring leaves the bound of what is pending)
            self.pending_bytes = self.pending_bytes - (bytes - #data)
            self.unacked:put(data)
            if self.own.n > 0 then
                -- (a call with a loop in it would keep this loop from
                -- being compiled, so only when there is something)
                release_own(self, first, last, self.unsent_q:len() == 0)
            end
            if not send(sock, link, data) then
                return nil, link.error
            end
            last_send = ngx_now()
        elseif ngx_now() - last_send >= hb / 2 then
            if not send(sock, link, control(T_PING)) then
                return nil, link.error
            end
            last_send = ngx_now()
        end
    end
end


-- The broker worker's writer: hands all that is queued to the broker in
-- this process. Nothing waits for acknowledgement: what the broker holds
-- dies with this process, and so does its publisher.
local function local_writer(self, link)
    while true do
        if #self.unsent == 0 then
            if self.stopping or link.closed then
                return true
            end
            self.writer_idle = true
            self.wsema:wait(1)
            self.writer_idle = false
        end
        if #self.unsent > 0 then
            local uq = self.unsent_q
            local first, n = uq:peek(), uq:len()
            local bytes = #self.unsent
            local batch
            if self.has_ring then
                -- runs in our ring: the broker gets their SHM frames
                batch = self.spare
                while #self.unsent > 0 do
                    batch:put((take(self)))
                end
            else
                uq:clear()
                -- publishes go on into the spare buffer while the broker
                -- takes this one (it may wait for a slow worker)
                batch = self.unsent
                self.unsent, self.spare = self.spare, batch
            end
            if self.own.n > 0 then
                release_own(self, first, self.seq, true)
            end
            local ok, err = broker.take_local(self, link.conn, batch)
            batch:reset()
            if not ok then
                -- frames we made ourselves: a bug, not a peer's fault
                log(ERR, "failed to hand events to the broker: ", err)
            end
            self.pending = self.pending - n
            self.pending_bytes = self.pending_bytes - bytes
            wake_publishers(self, n)
        end
    end
end


-- The broker worker talks to the broker without a socket.
local function run_local(self)
    local link = { closed = false }
    local st = { got = 0 }
    link.conn = broker.attach_local(self, function(batch)
        repeat
            wait_inbox_room(self, link)
            local need, err = consume(self, batch, st)
            if not need then
                return nil, err
            end
        until need ~= MORE
        return true
    end, function(p, len)
        local ok, err = receive_urgent(self, p, len)
        if not ok then
            log(ERR, "failed to handle an urgent event: ", err)
        end
    end, function(seq, run)
        own_unique(self, seq, run)
    end)
    self.local_link = link.conn
    self.connected = true
    self.ready = true
    local_writer(self, link)
    self.local_link = nil
    link.closed = true
    self.rspace:post(1)
    broker.detach_local(self, link.conn)
    self.connected = false
end


-- The frames of our run in the ring that the SHM frame at pp (len bytes)
-- stands for, appended to out, and (seq, bytes) per event to q. Returns
-- their bytes, or nil and the events lost: a run not acknowledged is
-- never written over (see take), so that is a bug, counted and logged.
local function expand_run(self, pp, len, out, q)
    local s = frame.check_shm(pp, len)
    local run = self.ring_buf
    if not (s and self.rings:get(self.worker, s.pos, s.len, run)) then
        local lost = s and s.events or 0
        local dropped = self.counters.dropped
        dropped.ring = (dropped.ring or 0) + lost
        log(ERR, "lost ", lost, " event(s) of ours not acknowledged: their "
            .. "run is gone from our ring")
        return nil, lost
    end
    local p, n = run:ref()
    local off = 0
    while off < n do
        local h, _, size = frame.at(p + off)
        q:push(frame.seq(h), size)
        off = off + size
    end
    out:putcdata(p, n)
    return n
end


-- After a reconnect, whatever the broker had not acknowledged goes again,
-- ahead of what was never sent: our runs in the ring as their events (a
-- new broker knows nothing of the ring; drop_oldest drops events), the
-- rest as it was sent.
local function requeue_unacked(self)
    if #self.unacked == 0 then
        return
    end
    local rest = self.unsent:get()
    local merged = fifo.new()
    -- (what was sent as it is goes so again: it holds what a ring cannot)
    local plain = fifo.new()
    local out = self.unsent
    local aq = self.unacked_q
    local p = self.unacked:ref()
    local off = 0
    while true do
        local seq, bytes = aq:pop()
        if not seq then
            break
        end
        -- (the events of a run but its last keep no bytes in unacked)
        if bytes > 0 then
            local h, pp = frame.at(p + off)
            if h.type == T_SHM then
                local n, lost = expand_run(self, pp, h.len, out, merged)
                if n then
                    self.pending_bytes = self.pending_bytes + n - bytes
                else
                    self.pending = self.pending - lost
                    self.pending_bytes = self.pending_bytes - bytes
                end
            else
                out:putcdata(p + off, bytes)
                merged:push(seq, bytes)
                plain:push(seq, 0)
            end
            off = off + bytes
        end
    end
    self.unsent_q:move_to(merged)
    self.unsent_q = merged
    out:put(rest)
    self.unacked:reset()
    self.ring_runs:clear()
    self.plain_q:move_to(plain)
    self.plain_q = plain
end


local function client_loop(premature, self)
    if premature then
        return
    end
    if self.worker == self.opts.broker then
        run_local(self)
        self.isema:post(1)
        return
    end
    local backoff = 0.01
    local first = true
    local down_since        -- the first failed attempt since the last link
    while not self.stopping do
        local sock = ngx.socket.tcp()
        sock:settimeout(2000)
        local ok, err, reason = handshake(self, sock)
        if ok then
            if not first then
                self.counters.reconnects = self.counters.reconnects + 1
            end
            first = false
            down_since = nil
            self.connected = true
            self.ready = true
            backoff = 0.01
            requeue_unacked(self)
            local link = { closed = false, error = nil, got = 0, acked = 0 }
            local wt = spawn(writer, self, sock, link)
            local lane = { closed = false, sema = semaphore.new(),
                           ended = false, done = semaphore.new() }
            local lane_started = timer_at(0, lane_timer, self, lane)
            local rok, rerr = reader(self, sock, link)
            link.closed = true
            self.wsema:post(1)
            lane.closed = true
            lane.sema:post(1)
            while lane_started and not lane.ended do
                lane.done:wait(1)
            end
            -- a writer stuck in a send to a dead broker is stopped here;
            -- what it was sending is still in unacked and goes again
            kill(wt)
            local wok, werr = not link.error, link.error
            self.connected = false
            sock:close()
            if self.stopping then
                break
            end
            if not rok or not wok then
                log(WARN, "lost the broker: ", rerr or werr,
                    "; reconnecting")
            end
        else
            sock:close()
            if reason then
                self.counters.rejected = self.counters.rejected + 1
            end
            if reason == "other generation" then
                -- an old worker during a reload: the old broker is gone
                if worker_exiting() then
                    break
                end
            else
                -- only a lasting failure is worth a warning: at a stop the
                -- broker worker may exit before this one has seen the
                -- signal, and a broker being respawned is back at once
                local now = ngx_now()
                down_since = down_since or now
                if now - down_since >= UNREACHABLE_WARN
                   and not worker_exiting() then
                    warn_once(self, "connect", "cannot reach the broker for ",
                              str_format("%.1f", now - down_since), " s: ",
                              err)
                end
            end
            if worker_exiting() and self.pending == 0 then
                break
            end
        end
        if self.stopping then
            break
        end
        ngx_sleep(backoff * (0.5 + random()))
        backoff = min(backoff * 2, 1)
    end
    -- (only at exit: publishes from now on would never leave)
    self.stopping = true
    self.connected = false
    release_held(self)
    self.isema:post(1)
end
_M.client_loop = client_loop


return _M
