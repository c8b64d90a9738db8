-- The job store of the timer engine: jobs in parallel arrays indexed by a
-- small integer id (an FFI struct for the numeric fields, grown without
-- copying by resty.loom.timer.array; Lua arrays for the callback and its
-- arguments), so a pending timer costs about 100 bytes and no table.


local ffi = require "ffi"
local bit = require "bit"
local array = require "resty.loom.timer.array"

local ffi_sizeof = ffi.sizeof
local arr_new = array.new
local arr_grow = array.grow
local band = bit.band
local type = type


pcall(ffi.cdef, [[
typedef struct {
    double   due;       /* nominal due time (us); remaining time if paused */
    double   interval;  /* us; 0 for one-shot timers */
    uint32_t gen;
    uint32_t site;      /* index of the site record; 0: none */
    uint8_t  state;
    uint8_t  flags;
    uint8_t  nargs;
    uint8_t  mode;
} loom_timer_job_t;
]])


local JOBS = ffi.typeof("loom_timer_job_t[?]")
local JOB_PTR = ffi.typeof("loom_timer_job_t *")
local JOB_SIZE = ffi_sizeof("loom_timer_job_t")

local FREE = 0
local PENDING = 1
local QUEUED = 2
local RUNNING = 3
local PAUSED = 4
local STATE_NAMES = { [PENDING] = "pending", [QUEUED] = "queued",
                      [RUNNING] = "running", [PAUSED] = "paused" }

local F_CANCEL = 1
local F_PAUSE = 2
local F_PREMATURE = 4
local F_EXTRA = 8           -- has a name, name statistics or max_run_time

local ONCE = 0
local FIXED_RATE = 1
local FIXED_DELAY = 2
local MODES = { fixed_rate = FIXED_RATE, fixed_delay = FIXED_DELAY }

-- a handle is the number gen * 2^24 + id; freeing a job bumps gen, so
-- stale handles are refused
local ID_SPAN = 16777216            -- 2^24 ids
local GEN_SPAN = 268435456          -- 2^28 generations
local MANY_ARGS = 255       -- job.nargs for 255 or more: the count is argv.n


-- the FFI array of n jobs (ids 1 to n - 1; id 0 is none)
local function new_store(n)
    return arr_new(JOB_PTR, JOBS, JOB_SIZE, n)
end


local function grow(self)
    local cap = self.cap * 2
    if cap > ID_SPAN - 1 then
        cap = ID_SPAN - 1
    end
    -- the arrays may move: callers re-read self.jobs after alloc()
    self.jobs = arr_grow(self.store, cap + 1)
    self.wheel:grow(cap)
    self.cap = cap
end


local function alloc(self)
    local n = self.nfree
    if n > 0 then
        local id = self.free[n]
        self.nfree = n - 1
        return id
    end
    local id = self.top + 1
    if id > self.cap then
        if self.cap >= ID_SPAN - 1 then
            return nil
        end
        grow(self)
    end
    self.top = id
    return id
end


local function handle_of(self, id)
    return self.jobs[id].gen * ID_SPAN + id
end


-- handle (number) or name (string) -> id of a live job, or nil
local function lookup(self, h)
    if type(h) == "string" then
        h = self.names[h]
        if not h then
            return nil
        end
    end
    if type(h) ~= "number" then
        return nil
    end
    local id = h % ID_SPAN
    if id < 1 or id > self.top then
        return nil
    end
    local j = self.jobs[id]
    if j.state == FREE or j.gen ~= (h - id) / ID_SPAN then
        return nil
    end
    return id
end


local function release_name(self, id)
    local name = self.name_of[id]
    if name then
        if self.names[name] == handle_of(self, id) then
            self.names[name] = nil
        end
        self.name_of[id] = nil
    end
end


local function free_job(self, id)
    local j = self.jobs[id]
    if j.state == PAUSED then
        self.paused = self.paused - 1
    end
    local extra = band(j.flags, F_EXTRA) ~= 0
    if extra then
        release_name(self, id)
    end
    j.state = FREE
    j.flags = 0
    j.gen = (j.gen + 1) % GEN_SPAN
    self.cb[id] = nil
    local n = j.nargs
    if n > 0 then
        self.a1[id] = nil
        if n > 1 then
            self.a2[id] = nil
            if n > 2 then
                self.argv[id] = nil
            end
        end
    end
    local si = j.site
    if si ~= 0 then
        local rec = self.site_list[si]
        rec.pending = rec.pending - 1
        j.site = 0
    end
    if extra then
        local rec = self.nrec[id]
        if rec then
            rec.pending = rec.pending - 1
            self.nrec[id] = nil
        end
        self.maxrt[id] = nil
    end
    local nf = self.nfree + 1
    self.free[nf] = id
    self.nfree = nf
    self.alive = self.alive - 1
end


local _M = {
    _VERSION = "0.2.0",
    PENDING = PENDING,
    QUEUED = QUEUED,
    RUNNING = RUNNING,
    PAUSED = PAUSED,
    STATE_NAMES = STATE_NAMES,
    F_CANCEL = F_CANCEL,
    F_PAUSE = F_PAUSE,
    F_PREMATURE = F_PREMATURE,
    F_EXTRA = F_EXTRA,
    ONCE = ONCE,
    FIXED_RATE = FIXED_RATE,
    FIXED_DELAY = FIXED_DELAY,
    MODES = MODES,
    ID_SPAN = ID_SPAN,
    GEN_SPAN = GEN_SPAN,
    MANY_ARGS = MANY_ARGS,
    new_store = new_store,
    alloc = alloc,
    handle_of = handle_of,
    lookup = lookup,
    release_name = release_name,
    free_job = free_job,
}


return _M
