-- A publisher's spool (opts.spool): the messages send() accepted, on disk,
-- so that a stop or a crash of the worker loses none of them.
--
-- spool_mode "always": each message is appended to a mapped file before
-- send() returns (put, a few stores) and marked done once acknowledged
-- or reported (done). "exit": what the worker still holds when it exits
-- is written then (keep). In both, a worker adopts the files whose writer
-- is gone and sends their messages first (tick, feed). The files are
-- spoolfile.lua's.


local ffi = require "ffi"
local buffer = require "resty.loom.publish.buffer"
local report = require "resty.loom.publish.report"
local spoolfile = require "resty.loom.publish.spoolfile"
local file = require "resty.loom.file"

local C = ffi.C
local ffi_cast = ffi.cast
local ffi_string = ffi.string
local ngx_now = ngx.now
local ngx_log = ngx.log
local ngx_ERR = ngx.ERR
local ngx_NOTICE = ngx.NOTICE
local timer_every = ngx.timer.every
local append = spoolfile.append
local release = spoolfile.release
local next_record = spoolfile.next_record
local record_bytes = spoolfile.record_bytes
local spool_put = spoolfile.put
local replay_batch = buffer.replay_batch
local replayed = buffer.replayed
local seal = buffer.seal
local fifo_new = buffer.fifo_new
local report_failure = report.failure
local tohex = require("bit").tohex
local concat = table.concat
local floor = math.floor
local min = math.min
local max = math.max
local pairs = pairs
local tonumber = tonumber

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } loom_spool_timespec_t;
int loom_spool_clock_gettime(int clk, loom_spool_timespec_t *tp)
    __asm__("clock_gettime");
]])
pcall(ffi.cdef, "long getrandom(void *buf, size_t len, unsigned int flags);")
pcall(ffi.cdef, "unsigned int getuid(void);")

local LOG_TAG = "[loom.publish] "
local REC = spoolfile.REC
local TICK = 1                  -- seconds between looks at the directory
local FEED_CHUNK = 2000         -- records read back per turn of a sender
local EXIT_BUDGET = 0.5         -- seconds the exit write may take
local PREFIX = '{"messages":['
local u8_ptr = ffi.typeof("uint8_t *")
local ts = ffi.new("loom_spool_timespec_t")


local _M = { _VERSION = "0.2.0" }


local function clock()
    C.loom_spool_clock_gettime(1, ts)       -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) / 1e9
end


-- 16 hex digits naming this worker's publisher in the ids of its messages
local function incarnation()
    local v = ffi.new("uint32_t[2]")
    if C.getrandom(v, 8, 0) ~= 8 then
        v[0] = (ngx.worker.pid() * 2654435761 + ngx_now() * 1000)
               % 4294967296
        v[1] = floor(ngx_now() * 1000) % 4294967296
    end
    return tohex(tonumber(v[0])) .. tohex(tonumber(v[1]))
end


-- The messages of the adopted files, read back into batches that go
-- before their ordering key's messages not yet sent, while they take at
-- most half the buffer; at most `limit` of them. True when some were.
local function feed(self, limit)
    local sp = self.spool
    local now = ngx_now()
    local max_msgs = self.buffer_max_messages / 2
    local max_bytes = self.buffer_max_bytes / 2
    local open = {}         -- ordering key -> the batch being filled
    local n = 0
    while n < limit
          and self.queued_messages + self.inflight_messages < max_msgs
          and self.queued_bytes + self.inflight_bytes < max_bytes
    do
        local p, klen, len, ref = next_record(sp)
        if not p then
            break
        end
        n = n + 1
        local key = klen > 0 and ffi_string(p + REC, klen) or ""
        local mlen = len - klen
        local msg = p + REC + klen          -- with its leading comma
        local q = self.queues[key]
        if q and q.paused then
            -- refused, as send() refuses the key
            report_failure(self, q, PREFIX .. ffi_string(msg + 1, mlen - 1)
                           .. "]}", 1, "ordering key paused", 0, nil)
            release(sp, ref)
        else
            local b = open[key]
            if b and (b.n >= self.batch_max_messages
                      or b.bytes + mlen > self.batch_max_bytes)
            then
                seal(self, b)
                b = nil
            end
            if not b then
                b = replay_batch(self, key, now)
                open[key] = b
            end
            b.buf:putcdata(msg, mlen)
            replayed(self, b, mlen, now, ref)
            sp.replayed = sp.replayed + 1
        end
    end
    for _, b in pairs(open) do
        seal(self, b)
    end
    return n > 0
end


-- once a second, and at start: adopts a file whose writer is gone (when
-- none is being read; the next one when it held nothing live) and reads
-- messages back; true when some were
local function tick(self)
    local sp = self.spool
    if self.exiting or self.closed then
        return false
    end
    spoolfile.age(sp)
    for _ = 1, 16 do
        if not spoolfile.pending(sp) and not spoolfile.adopt_next(sp) then
            return false
        end
        if feed(self, FEED_CHUNK) then
            return true
        end
        if spoolfile.pending(sp) then
            return false        -- the buffer is half full
        end
    end
    return false
end


local function on_tick(premature, self, start)
    if premature then
        return
    end
    if tick(self) and not self.running then
        start(self)
    end
end


-- In a worker: makes spool directory dir if missing and checks that this
-- worker may write there; true, or nil and why the spool cannot be used.
function _M.check_dir(dir)
    local ok, err = file.mkdirs(dir, 448)
    if ok then
        ok, err = file.writable(dir)
    end
    if not ok then
        return nil, "opts.spool cannot be used: " .. err
                    .. " (this worker runs as uid " .. tonumber(C.getuid())
                    .. ")"
    end
    return true
end


-- In a worker, after check_dir(): adopts what earlier workers left and
-- starts looking for more once a second. start: the senders' start().
function _M.setup(self, start)
    local dir = self.spool_dir
    local max_bytes = self.spool_max_bytes
    local sp = spoolfile.new({
        dir = dir, name = self.name, pid = ngx.worker.pid(),
        start = ngx_now(), max_bytes = max_bytes,
        -- files of 1/16 of the spool: 16 MiB at the default 256 MiB
        file_bytes = min(16 * 1048576,
                         max(65536, floor(max_bytes / 16 / 4096) * 4096)),
        warn_interval = self.warn_interval,
    })
    self.spool = sp
    if self.spool_mode == "always" then
        self.spool_always = sp
    end
    self.id_prefix = incarnation() .. "-"
    if tick(self) then
        -- the rest of what was adopted, as far as the buffer allows
        while feed(self, FEED_CHUNK) do end
        start(self)
    end
    local ok, err = timer_every(TICK, on_tick, self, start)
    if not ok then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": spool: failed to start ",
                "its timer: ", err, "; files left by other workers are ",
                "read only at the next start")
    end
    return true
end


-- the ref of the message just added to batch b (always mode): in the
-- spool before send() returns, or memory only when the spool fails
function _M.put(sp, b, key, out, len)
    local p, n = out:ref()
    local ref = append(sp, key, #key, p + n - len, len)
    if ref then
        b.refs[b.total] = ref
    end
end


-- the messages of batch b are done with (acknowledged or reported)
function _M.done(self, b)
    local refs = b.refs
    if refs then
        local sp = self.spool
        for i = b.head, b.total do
            local r = refs[i]
            if r then
                release(sp, r)
            end
        end
    end
end


-- Reads the adopted files on while they have messages and the buffer
-- room (after a batch landed).
function _M.feed(self)
    if spoolfile.pending(self.spool) and not self.exiting then
        feed(self, FEED_CHUNK)
    end
end


-- fn(i, p, len, comma) for each message of batch b: p its JSON, len
-- bytes, comma true when they lack the leading comma (the first of a
-- request body)
local function each_message(b, fn)
    local lens = b.lens
    if b.buf then
        local p = b.buf:ref()
        for i = b.head, b.total do
            local len = lens[i]
            fn(i, p, len, false)
            p = p + len
        end
        return
    end
    local body = concat(b.body)
    local p = ffi_cast(u8_ptr, body) + #PREFIX
    for i = b.head, b.total do
        local len = lens[i]
        if i == b.head then
            fn(i, p, len - 1, true)
            p = p + len - 1
        else
            fn(i, p, len, false)
            p = p + len
        end
    end
    return #body        -- (body stays alive until here)
end


-- reports the messages of batch b not in the spool as not delivered
local function report_left(self, b, why)
    local refs = b.refs
    local msgs = {}
    each_message(b, function(i, p, len, comma)
        if not (refs and refs[i]) then
            msgs[#msgs + 1] = comma and ffi_string(p, len)
                              or ffi_string(p + 1, len - 1)
        end
    end)
    report_failure(self, b.q, PREFIX .. concat(msgs, ",") .. "]}", #msgs,
                   "worker exiting: not written to the spool (" .. why
                   .. ")", 0, nil)
    return #msgs
end


-- At worker exit: writes every message this publisher holds and the
-- spool does not (all of them in exit mode; in always mode those taken
-- while the spool failed) to a new file, within EXIT_BUDGET and
-- spool_max_bytes; reports the others (on_error, one log line). Then the
-- publisher is closed and its files too. Returns how many messages are
-- in the spool and how many were reported.
function _M.keep(self)
    local sp = self.spool
    local t0 = clock()
    -- in flight or cut at the exit budget first: older than the queued
    local list = {}
    for b in pairs(self.sending) do
        list[#list + 1] = b
    end
    local kept = self.kept
    for i = 1, #kept do
        list[#list + 1] = kept[i]
    end
    for _, q in pairs(self.queues) do
        local bs = q.batches
        for i = bs.first, bs.last do
            list[#list + 1] = bs[i]
        end
    end

    local room = sp.max - sp.bytes
    local plan, lost, reasons = {}, {}, {}
    local bytes, already, count = 0, 0, 0
    for i = 1, #list do
        local b = list[i]
        local refs, lens = b.refs, b.lens
        local klen = #b.q.key
        local need, n = 0, 0
        for j = b.head, b.total do
            if refs and refs[j] then
                already = already + 1
            else
                n = n + 1
                need = need + record_bytes(klen, lens[j])
            end
        end
        if n > 0 then
            if bytes + need <= room then
                plan[#plan + 1] = b
                bytes = bytes + need
                count = count + n
            else
                lost[#lost + 1] = b
                reasons[b] = "spool_max_bytes reached"
            end
        end
    end

    local f, err
    if bytes > 0 then
        f, err = spoolfile.exit_file(sp, bytes)
    end
    local written = 0
    for i = 1, #plan do
        local b = plan[i]
        if not f then
            lost[#lost + 1] = b
            reasons[b] = err
        elseif clock() - t0 > EXIT_BUDGET then
            lost[#lost + 1] = b
            reasons[b] = "time budget spent"
        else
            local refs, key = b.refs, b.q.key
            local klen = #key
            each_message(b, function(j, p, len, comma)
                if not (refs and refs[j]) then
                    spool_put(sp, f, key, klen, p, len, comma)
                    written = written + 1
                end
            end)
        end
    end
    local took = clock() - t0

    local nlost = 0
    local why
    for i = 1, #lost do
        local b = lost[i]
        why = reasons[b]
        nlost = nlost + report_left(self, b, why)
    end
    -- nothing is held any more
    self.queues, self.sending, self.kept = {}, {}, {}
    self.opening, self.sealed = fifo_new(), fifo_new()
    self.queued_messages, self.queued_bytes = 0, 0
    self.inflight_messages, self.inflight_bytes, self.inflight = 0, 0, 0
    self.closed = true
    spoolfile.close(sp)
    if written + already > 0 then
        ngx_log(ngx_NOTICE, LOG_TAG, self.name, ": ", written + already,
                " messages kept in the spool at worker exit (", written,
                " written in ", floor(took * 1e6) / 1e3, " ms, ", already,
                " there already)")
    end
    if nlost > 0 then
        ngx_log(ngx_ERR, LOG_TAG, self.name, ": ", nlost,
                " messages not delivered at worker exit (not written to ",
                "the spool: ", why, ")")
    end
    return written + already, nlost, count
end


-- how many messages of publisher p are held in memory and in its spool
-- (for the check at VM close)
function _M.in_files(p)
    local n = 0
    local function count(b)
        local refs = b.refs
        if refs then
            for i = b.head, b.total do
                if refs[i] then
                    n = n + 1
                end
            end
        end
    end
    for b in pairs(p.sending) do
        count(b)
    end
    for _, q in pairs(p.queues) do
        local bs = q.batches
        for i = bs.first, bs.last do
            count(bs[i])
        end
    end
    return n
end


return _M
