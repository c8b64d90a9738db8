-- Rings in memory shared by the workers, one per publishing worker: a
-- run of events to "all" or "others" is written once into its
-- publisher's ring and travels through the broker as one small SHM frame
-- (position, length, count), so the broker neither reads nor copies its
-- bytes and each receiver copies them once. The region is mapped by the
-- bus made in the master (init phase), before the fork, so every worker
-- of this generation sees it, a respawned one too; a reload maps another.
--
-- A ring holds runs at growing byte positions (doubles; a run never
-- wraps). The broker frees a run once no queue holds its SHM frame
-- (free); the publisher writes only below free + size, and before it
-- writes over older bytes it raises tail, so a reader that finds tail
-- past its run after copying it knows the copy is not the run.


local ffi = require "ffi"
-- declares mmap and munmap (one place for them)
require "resty.loom.file"

local C = ffi.C
local ffi_cast = ffi.cast
local ffi_sizeof = ffi.sizeof
local ffi_copy = ffi.copy
local setmetatable = setmetatable


ffi.cdef [[
void ngx_loom_ffi_fence(void);

typedef struct {
    double  head;       /* the end of the last run written */
    double  tail;       /* bytes before it may have been written over */
    double  free;       /* the broker no longer needs runs before it */
    double  reserved;
} loom_ev_ring_t;

typedef struct {
    double    pos;
    uint32_t  len;
    uint32_t  events;
} loom_ev_run_t;
]]


local RING_PTR = ffi.typeof("loom_ev_ring_t *")
local RUN_PTR = ffi.typeof("loom_ev_run_t *")
local RING_HEAD = 64                -- a ring's header, a cache line
local RUN_SIZE = ffi_sizeof("loom_ev_run_t")

local fence      -- ngx_loom_ffi_fence, resolved by new()

local PROT_READ, PROT_WRITE = 1, 2
local MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20
local MAP_FAILED = ffi_cast("void *", -1)


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


-- Maps a ring of size bytes (a multiple of 8) for each of slots workers.
-- Returns the rings, or nil and why. Pages are touched only as the rings
-- fill; the mapping goes with the Lua VM that made it (the workers keep
-- their copy).
function _M.new(slots, size)
    fence = C.ngx_loom_ffi_fence
    local slot = RING_HEAD + size
    local len = slots * slot
    local p = C.mmap(nil, len, PROT_READ + PROT_WRITE,
                     MAP_SHARED + MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED then
        return nil, "failed to map " .. len .. " bytes: errno "
                    .. ffi.errno()
    end
    local base = ffi.gc(ffi_cast("uint8_t *", p), function(q)
        C.munmap(q, len)
    end)
    return setmetatable({ base = base, slots = slots, size = size,
                          slot = slot }, mt)
end


local function ring(self, wid)
    return ffi_cast(RING_PTR, self.base + wid * self.slot)
end


-- where a run of len bytes goes in ring r: its position and end, or nil
-- when the ring has no room for it: the broker still needs what is
-- there, or the publisher does (keep: its oldest run not acknowledged,
-- which it re-sends after a reconnect)
local function place(r, size, len, keep)
    local head = r.head
    local need = RUN_SIZE + len
    need = need + (-need) % 8
    local off = head % size
    if off + need > size then
        -- (a run never wraps: the rest of the ring is skipped)
        head = head + (size - off)
    end
    local stop = head + need
    local low = r.free
    if keep and keep < low then
        low = keep
    end
    if stop - low > size then
        return nil
    end
    return head, stop
end


-- the end of the run at pos of len bytes
function _M.run_end(pos, len)
    local need = RUN_SIZE + len
    return pos + need + (-need) % 8
end


-- whether worker wid has a ring
function _M.has(self, wid)
    return wid >= 0 and wid < self.slots
end


-- whether worker wid's ring has room for a run of len bytes now (keep:
-- see place)
function _M.room(self, wid, len, keep)
    return place(ring(self, wid), self.size, len, keep) ~= nil
end


-- Writes the len bytes at p (n events) into worker wid's ring. Returns the
-- run's position, or nil when the ring has no room.
function _M.put(self, wid, p, len, n, keep)
    local r = ring(self, wid)
    local size = self.size
    local pos, stop = place(r, size, len, keep)
    if not pos then
        return nil
    end
    if stop - size > r.tail then
        r.tail = stop - size
        -- (readers must see the tail raised before the bytes it frees
        -- change)
        fence()
    end
    local at = self.base + wid * self.slot + RING_HEAD + pos % size
    local run = ffi_cast(RUN_PTR, at)
    run.pos = pos
    run.len = len
    run.events = n
    ffi_copy(at + RUN_SIZE, p, len)
    fence()
    r.head = stop
    return pos
end


-- worker wid's run at pos of len bytes: its header and bytes, or nil
-- when no run starts there (never trust a peer's numbers)
local function run_at(self, wid, pos, len)
    local size = self.size
    if not (wid >= 0 and wid < self.slots) or pos < 0 or pos % 8 ~= 0
       or pos % size + RUN_SIZE + len > size then
        return nil
    end
    local at = self.base + wid * self.slot + RING_HEAD + pos % size
    local run = ffi_cast(RUN_PTR, at)
    if run.pos ~= pos or run.len ~= len then
        return nil
    end
    return run, at + RUN_SIZE
end


-- whether worker wid's ring holds a run of n events at pos, len bytes
function _M.check(self, wid, pos, len, n)
    local run = run_at(self, wid, pos, len)
    return run ~= nil and run.events == n and pos >= ring(self, wid).tail
end


-- Copies worker wid's run at pos (len bytes) into buf, which it resets
-- first. Returns true, or false when the run is not there (written over,
-- or never was).
function _M.get(self, wid, pos, len, buf)
    buf:reset()
    local run, p = run_at(self, wid, pos, len)
    if not run or pos < ring(self, wid).tail then
        return false
    end
    buf:putcdata(p, len)
    -- (the copy before the second look at the tail: see put)
    fence()
    if pos < ring(self, wid).tail then
        -- written over while we copied
        buf:reset()
        return false
    end
    return true
end


-- the broker no longer needs worker wid's runs before pos (nil: any of
-- them)
function _M.release(self, wid, pos)
    local r = ring(self, wid)
    pos = pos or r.head
    if pos > r.free then
        r.free = pos
    end
end


-- every ring's head: wid -> the end of its last run written
function _M.heads(self)
    local out = {}
    for wid = 0, self.slots - 1 do
        out[wid] = ring(self, wid).head
    end
    return out
end


-- bytes of worker wid's ring that the broker still needs
function _M.held(self, wid)
    local r = ring(self, wid)
    return r.head - r.free
end


-- whether any ring holds runs a broker has not freed
function _M.held_any(self)
    for wid = 0, self.slots - 1 do
        local r = ring(self, wid)
        if r.head > r.free then
            return true
        end
    end
    return false
end


return _M
