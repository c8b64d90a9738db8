-- The node's reader: the worker holding the node's lease (elect) reads the
-- node's consumer group and the shared "one" group (XREADGROUP, pending
-- entries first, XAUTOCLAIM of what dead nodes left), hands each batch to
-- the workers over the bus and XACKs it once every worker confirmed it.


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local rconn = require "resty.loom.cluster.redis"
local resp = require "resty.loom.cluster.resp"
local stats = require "resty.loom.cluster.stats"
local sender = require "resty.loom.cluster.sender"
local receiver = require "resty.loom.cluster.receiver"
local janitor = require "resty.loom.cluster.janitor"

local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_null = ngx.null
local ngx_ERR = ngx.ERR
local ngx_WARN = ngx.WARN
local ngx_NOTICE = ngx.NOTICE
local timer_at = ngx.timer.at
local worker_exiting = ngx.worker.exiting
local thread_spawn = ngx.thread.spawn
local thread_wait = ngx.thread.wait
local encode = buffer.encode
local floor = math.floor
local min = math.min
local unpack = unpack
local type = type
local xpcall = xpcall
local tostring = tostring
local tonumber = tonumber
local traceback = debug.traceback
local str_find = string.find
local clear_tab = require "table.clear"
local table_remove = table.remove
local count = stats.count
local log_throttled = stats.log_throttled
local resp_put = resp.put
local resp_exchange = resp.exchange
local mark_node_down = sender.mark_node_down
local maintain = janitor.maintain

local LOG_TAG = "[loom.cluster] "
local SRC = receiver.SRC
local CHUNK = 512 * 1024          -- a bus message holds at most this
                                  -- much of a batch's data
local MAX_INFLIGHT = 4            -- batches handed over, not confirmed yet
local ACK_LAG = 5                 -- ms: BLOCK while batches are in flight


local _M = { _VERSION = "0.2.0" }

_M.MAX_INFLIGHT = MAX_INFLIGHT


-- hands items (encoded events) to the workers in messages of at most
-- CHUNK bytes; each message is to be confirmed by `need` workers (w.need
-- counts them); node: the items are handled once per node
local function hand_to_workers(self, w, need, target, items, node)
    local from, bytes = 1, 0
    local n = #items
    for i = 1, n do
        bytes = bytes + #items[i]
        if bytes >= CHUNK or i == n then
            local part = items
            if from > 1 or i < n then
                part = { unpack(items, from, i) }
            end
            w.need = w.need + need
            local ok, err = self.bus:publish(target, SRC, "batch",
                                             { b = w.b, r = self.wid,
                                               items = part, node = node })
            if not ok then
                return nil, err
            end
            from, bytes = i + 1, 0
        end
    end
    return true
end


-- entries -> a batch in flight: w.ids are to be acknowledged once the
-- workers confirmed (w.got == w.need), w.now at once (dead letters and
-- entries trimmed away); nil, err when Redis failed
local function deliver(self, red, key, entries, counts)
    local all, here, now, ids = {}, {}, {}, {}
    local dead = 0
    red:init_pipeline()
    for k = 1, #entries do
        local e = entries[k]
        local id, f = e[1], e[2]
        if type(f) ~= "table" then
            -- trimmed away while pending (XREADGROUP 0 returns it empty)
            now[#now + 1] = id
            count(self, "trimmed")
        else
            local n = counts and counts[id] or 1
            local t = f[1] == "t" and f[3] == "p" and f[2]
            if not (t == "c" or t == "n" or t == "o") or #f ~= 4
               or n > self.max_deliveries
            then
                red:xadd(self.stream_dead, "MAXLEN", "~", 10000, "*",
                         "stream", key, "entry", id, "group",
                         key == self.stream and self.node_id or "one",
                         "deliveries", n, "fields", encode(f))
                now[#now + 1] = id
                dead = dead + 1
            else
                local to = t == "c" and all or here
                to[#to + 1] = f[4]
                ids[#ids + 1] = id
            end
        end
    end
    if dead > 0 then
        local res, err = red:commit_pipeline()
        if not res then
            return nil, "failed to dead-letter: " .. tostring(err)
        end
        count(self, "dead_letters", dead)
        log_throttled(self, ngx_ERR, "dead", dead .. " entries of " .. key
                      .. " moved to " .. self.stream_dead)
    else
        red:cancel_pipeline()
    end
    local b = self.next_batch + 1
    self.next_batch = b
    ngx_update_time()
    local w = { b = b, need = 0, got = 0, sema = semaphore.new(), ids = ids,
                now = now, n = #ids, deadline = ngx_now() + self.ack_timeout }
    self.waits[b] = w
    local ok, err = true, nil
    if #all > 0 then
        ok, err = hand_to_workers(self, w, self.nworkers, "all", all)
    end
    if ok and #here > 0 then
        -- "nodes" and "one" events: this worker handles them for the node
        ok, err = hand_to_workers(self, w, 1, "current", here, true)
    end
    if not ok then
        w.failed = err
    end
    return w
end


-- takes the batches in flight whose workers confirmed, from the oldest,
-- adding their ids to `acks`; waits for the oldest when `all` or when
-- MAX_INFLIGHT are in flight. Returns false when one timed out (its
-- entries stay pending, to be read again)
local function settle(self, inflight, acks, all)
    local fine = true
    while #inflight > 0 do
        local w = inflight[1]
        if w.got < w.need and not w.failed then
            if not all and #inflight < MAX_INFLIGHT then
                break
            end
            ngx_update_time()
            local left = w.deadline - ngx_now()
            if left > 0 then
                w.sema:wait(left)
            end
        end
        for i = 1, #w.now do
            acks[#acks + 1] = w.now[i]
        end
        if w.got >= w.need and not w.failed then
            for i = 1, w.n do
                acks[#acks + 1] = w.ids[i]
            end
        else
            fine = false
            count(self, "ack_timeouts")
            log_throttled(self, ngx_WARN, "ack", "workers did not confirm "
                          .. "a batch of " .. w.n .. " events ("
                          .. tostring(w.failed or "timeout")
                          .. "); they stay pending")
        end
        self.waits[w.b] = nil
        table_remove(inflight, 1)
    end
    return fine
end


-- XPENDING delivery counts of a run of pending entries
local function pending_counts(red, key, group, consumer, entries)
    local res = red:xpending(key, group, entries[1][1],
                             entries[#entries][1], #entries, consumer)
    local counts = {}
    if type(res) == "table" then
        for i = 1, #res do
            counts[res[i][1]] = tonumber(res[i][4])
        end
    end
    return counts
end


local function resync(self, why)
    count(self, "resyncs")
    ngx_log(ngx_ERR, LOG_TAG, "the group of this node ", why, ": events ",
            "published meanwhile are lost; telling the workers to ",
            "resynchronise")
    self.bus:publish("all", SRC, "resync", why)
end


local function flush_acks(self, red, key, group, acks)
    if #acks == 0 then
        return true
    end
    local n, err = red:xack(key, group, unpack(acks))
    if not n then
        return nil, "failed to ack: " .. tostring(err)
    end
    count(self, "acked", #acks)
    clear_tab(acks)
    return true
end


-- creates the group; a group this node had and lost (Redis lost its data,
-- or the janitor removed it after group_idle) means a resync
local function create_group(self, red, key, group, from)
    local ok, err = red:xgroup("CREATE", key, group, from, "MKSTREAM")
    if not ok then
        if str_find(tostring(err), "BUSYGROUP", 1, true) then
            self.dict:set("joined:" .. key, true)
            return true
        end
        return nil, "failed to create group " .. group .. ": "
                    .. tostring(err)
    end
    if key == self.stream then
        local removed = red:hdel(self.stream .. ":removed", self.node_id)
        if removed == 1 then
            resync(self, "was removed after opts.group_idle")
        elseif self.dict:get("joined:" .. key) then
            resync(self, "was lost by Redis")
        end
    end
    self.dict:set("joined:" .. key, true)
    return true
end


-- one stream, one group: pending entries first, then new ones; "one"
-- also claims entries other consumers left idle for claim_idle
local function consume(self, red, key, group, from)
    local ok, err = create_group(self, red, key, group, from)
    if not ok then
        return nil, err
    end
    local consumer = self.node_id
    local cursor = "0"
    local r, reply = resp.reader(red), {}
    local block = floor(self.block * 1000)
    local read_new = { "XREADGROUP", "GROUP", group, consumer, "COUNT",
                       self.batch, "BLOCK", block, "STREAMS", key, ">" }
    local ack_args = { "XACK", key, group }
    local inflight, acks = {}, {}
    local next_chores = 0
    local conf, gen = self.redis, self.redis.gen
    -- a failover started or ended (gen): read from the master from now on
    while self.reading and not worker_exiting() and conf.gen == gen do
        ngx_update_time()
        if ngx_now() >= next_chores then
            next_chores = ngx_now() + min(self.claim_idle / 2, 10)
            if key == self.stream then
                ok, err = maintain(self, red)
            else
                local res
                res, err = red:xautoclaim(key, group, consumer,
                                          floor(self.claim_idle * 1000),
                                          "0-0", "COUNT", self.batch)
                ok = res
                if type(res) == "table" and type(res[2]) == "table"
                   and #res[2] > 0
                then
                    count(self, "claimed", #res[2])
                    cursor = "0"    -- they are ours now: read as pending
                end
            end
            if not ok then
                return nil, err
            end
        end
        local res
        if cursor then
            -- the pending list: one batch at a time
            if not settle(self, inflight, acks, true) then
                cursor = "0"
            end
            ok, err = flush_acks(self, red, key, group, acks)
            if not ok then
                return nil, err
            end
            res, err = red:xreadgroup("GROUP", group, consumer, "COUNT",
                                      self.batch, "STREAMS", key, cursor)
        else
            if not settle(self, inflight, acks, false) then
                cursor = "0"    -- read what was not confirmed again
            end
            local n = 1
            if #acks > 0 then
                for i = 1, #acks do
                    ack_args[3 + i] = acks[i]
                end
                resp_put(r.out, ack_args, 3 + #acks)
                n = 2
            end
            -- while batches are in flight, come back soon to ack them
            read_new[8] = #inflight > 0 and ACK_LAG or block
            resp_put(r.out, read_new, 11)
            ok, err = resp_exchange(r, n, reply)
            if ok and n == 2 then
                count(self, "acked", #acks)
            end
            clear_tab(acks)
            res = ok and reply[n]
            if not ok and not str_find(tostring(err), "NOGROUP", 1, true)
            then
                return nil, "failed to read " .. key .. ": " .. tostring(err)
            end
        end
        if not res then
            if str_find(tostring(err), "NOGROUP", 1, true) then
                -- lost or removed while this reader was connected
                ok, err = create_group(self, red, key, group, "$")
                if not ok then
                    return nil, err
                end
            else
                return nil, "failed to read " .. key .. ": " .. tostring(err)
            end
        end
        local entries = res and res ~= ngx_null and res[1][2]
        if cursor and (not entries or #entries == 0) then
            cursor = nil       -- pending list done
        elseif entries and #entries > 0 then
            count(self, "read", #entries)
            local counts
            if cursor then
                counts = pending_counts(red, key, group, consumer, entries)
                cursor = entries[#entries][1]
            end
            local w
            w, err = deliver(self, red, key, entries, counts)
            if not w then
                return nil, err
            end
            inflight[#inflight + 1] = w
        end
    end
    -- leaving (reload, quit, lease lost): acknowledge what was confirmed
    settle(self, inflight, acks, true)
    return flush_acks(self, red, key, group, acks)
end


local function read_forever(self, key, group, from)
    local fails = 0
    while self.reading and not worker_exiting() do
        local red, err = rconn.connect(self.redis, self.block + 5)
        local ok
        mark_node_down(self, not red)
        if red then
            if fails > 0 then
                ngx_log(ngx_NOTICE, LOG_TAG, "reading ", key, " again")
            end
            fails = 0
            ok, err = consume(self, red, key, group, from)
            red:close()
        end
        if not ok then
            fails = fails + 1
            count(self, "read_errors")
            log_throttled(self, rconn.log_level(err), "read " .. key,
                          "reader: " .. tostring(err))
            ngx_sleep(rconn.backoff(fails, self.backoff_min,
                                    self.backoff_max))
        end
    end
end


local function release(self)
    self.reading = false
    if self.dict:get("reader") == self.token then
        self.dict:delete("reader")
    end
end


local function reader(premature, self)
    if premature then
        release(self)
        return
    end
    ngx_log(ngx_NOTICE, LOG_TAG, "worker ", self.wid, " reads for node ",
            self.node_id)
    count(self, "reader_elections")
    local one = thread_spawn(read_forever, self, self.stream_one, "one", "0")
    local ok, err = xpcall(read_forever, traceback, self, self.stream,
                           self.node_id, "$")
    if not ok then
        ngx_log(ngx_ERR, LOG_TAG, "reader failed: ", err)
    end
    self.reading = false
    thread_wait(one)
    release(self)
end


-- the node's reader lease, in the shared dict (shared by the generations
-- of a reload, so old and new workers never read at once)
local function elect(premature, self)
    if premature then
        return
    end
    local dict = self.dict
    if self.reading then
        if dict:get("reader") == self.token then
            dict:set("reader", self.token, self.lease_ttl)
        else
            self.reading = false          -- lost it (a stall past the ttl)
        end
        return
    end
    if worker_exiting() then
        return
    end
    if dict:add("reader", self.token, self.lease_ttl) then
        self.reading = true
        local ok, err = timer_at(0, reader, self)
        if not ok then
            release(self)
            ngx_log(ngx_ERR, LOG_TAG, "failed to start the reader: ", err)
        end
    end
end


_M.elect = elect


return _M
