-- The handled-event marks of a node's workers, kept in a file mapped into
-- memory so that they outlive the node's processes.
--
-- Every worker appends a record as soon as an event's handlers ran (a few
-- memory stores, no system call). A worker's successor, or the whole node
-- started again after a SIGKILL, reads the records back into the shared
-- dict before it handles anything, so the entries Redis still holds as
-- pending (handled, not yet acknowledged) are not handled twice. The
-- kernel's page cache keeps the stores of a killed process; a machine that
-- loses power loses the unsynced ones (and everything else in memory).
--
-- Layout: a header, then two regions per worker slot (a reload's old and
-- new generation each write their own), each with two segments written in
-- turn: when one is full the older one is emptied and written, so the
-- newest `seg_bytes` of records at least are always kept.

local ffi = require "ffi"
local bit = require "bit"
-- declares open, lseek, ftruncate, mmap, kill ... (one place for them)
local file = require "resty.loom.file"

local C = ffi.C
local ffi_cast = ffi.cast
local ffi_copy = ffi.copy
local ffi_string = ffi.string
local band = bit.band
local bxor = bit.bxor
local tobit = bit.tobit
local crc32 = ngx.crc32_short
local floor = math.floor
local tonumber = tonumber


ffi.cdef [[
typedef struct {
    char     magic[8];
    uint32_t version;
    uint32_t regions;
    uint32_t seg_bytes;
} loom_marks_head_t;

typedef struct {
    int32_t  owner;         /* pid of the worker writing it; 0: none */
    uint32_t cur;           /* the segment being written: 0 or 1 */
    uint32_t fill[2];       /* bytes of complete records in each */
} loom_marks_region_t;

typedef struct {
    uint32_t check;
    uint16_t size;          /* the whole record, a multiple of 8 */
    uint8_t  kind;
    uint8_t  klen;
    double   value;
} loom_marks_rec_t;
]]

local MAGIC = "loommrk"
local VERSION = 1
local HEAD = 64                   -- bytes reserved for each header
local REC = 16                    -- bytes of a record before its key
local MAX_KEY = 255
local O_RDWR, O_CREAT, O_CLOEXEC = 2, 64, 524288
local SEEK_END = 2
local PROT_RW, MAP_SHARED = 3, 1

local head_ptr = ffi.typeof("loom_marks_head_t *")
local region_ptr = ffi.typeof("loom_marks_region_t *")
local rec_ptr = ffi.typeof("loom_marks_rec_t *")
local char_ptr = ffi.typeof("char *")
local MAP_FAILED = ffi_cast("void *", -1)

local _M = {
    _VERSION = "0.2.0",
    CLUSTER = 1,        -- value: the highest sequence of a publisher
    NODE = 2,           -- one event handled once per node
}

local syserr = file.syserr


local function check(kind, key, value)
    return bxor(crc32(key), tobit(value), kind)
end


local function create(path, recreate)
    if recreate then
        -- a new file, so that processes still mapping the old one (a
        -- reload that changed the layout) keep theirs intact
        C.unlink(path)
    end
    local fd = C.open(path, O_RDWR + O_CREAT + O_CLOEXEC, ffi_cast("int", 384))
    if fd < 0 then
        return nil, syserr("open", path)
    end
    return fd
end


local function ours(h, regions, seg_bytes)
    return ffi_string(h.magic, 7) == MAGIC and h.version == VERSION
           and h.regions == regions and h.seg_bytes == seg_bytes
end


-- maps the file, made anew when its size or header is not this layout's;
-- p, or nil, err
local function map(path, bytes, regions, seg_bytes, recreate)
    local fd, err = create(path, recreate)
    if not fd then
        return nil, err
    end
    local size = tonumber(C.lseek(fd, 0, SEEK_END))
    local fresh = size ~= bytes
    if fresh and size > 0 and not recreate then
        C.close(fd)
        return map(path, bytes, regions, seg_bytes, true)
    end
    if fresh and C.ftruncate(fd, bytes) ~= 0 then
        err = syserr("size", path)
        C.close(fd)
        return nil, err
    end
    local p = C.mmap(nil, bytes, PROT_RW, MAP_SHARED, fd, 0)
    err = p == MAP_FAILED and syserr("map", path)
    C.close(fd)
    if err then
        return nil, err
    end
    -- unmapped with the Lua VM that mapped it (a reload's old master VM);
    -- forked workers have their own copy of the mapping
    p = ffi.gc(ffi_cast(char_ptr, p), function(q) C.munmap(q, bytes) end)
    local h = ffi_cast(head_ptr, p)
    if not ours(h, regions, seg_bytes) then
        if not fresh then
            return map(path, bytes, regions, seg_bytes, true)
        end
        ffi_copy(h.magic, MAGIC, 7)
        h.version, h.regions, h.seg_bytes = VERSION, regions, seg_bytes
    end
    return p
end


-- the marks file of a node with `workers` worker slots, keeping at least
-- `seg_bytes` of records per slot; nil, err
function _M.open(path, workers, seg_bytes)
    seg_bytes = band(seg_bytes + 7, -8)
    local regions = 2 * workers
    local bytes = HEAD + regions * (HEAD + 2 * seg_bytes)
    local base, err = map(path, bytes, regions, seg_bytes)
    if not base then
        return nil, err
    end
    return { base = base, regions = regions, seg_bytes = seg_bytes,
             path = path }
end


local function region_at(store, r)
    return store.base + HEAD + r * (HEAD + 2 * store.seg_bytes)
end


-- calls fn(kind, key, value) for every complete record of region r
local function each_record(store, r, fn)
    local p = region_at(store, r)
    local reg = ffi_cast(region_ptr, p)
    for s = 0, 1 do
        local seg = p + HEAD + s * store.seg_bytes
        local fill = reg.fill[s]
        if fill > store.seg_bytes then
            fill = 0            -- not written by this code
        end
        local off = 0
        while off + REC <= fill do
            local rec = ffi_cast(rec_ptr, seg + off)
            local size = rec.size
            if size < REC or off + size > fill then
                break
            end
            local key = ffi_string(seg + off + REC, rec.klen)
            local value = rec.value
            if tobit(rec.check) == check(rec.kind, key, value) then
                fn(rec.kind, key, value, floor(r / 2))
            end
            off = off + size
        end
    end
end


local alive = file.alive


-- worker `slot` (pid `pid`) takes one of its slot's two regions: one no
-- live process writes. `dict` tells which owners belong to this run of
-- the node (a pid recorded by an earlier run may be reused by now). Nil
-- when both are taken (two reloads in quick succession).
function _M.attach(store, slot, pid, dict)
    for r = 2 * slot, 2 * slot + 1 do
        local reg = ffi_cast(region_ptr, region_at(store, r))
        local owner = reg.owner
        local key = "mk:o:" .. r
        if owner == 0 or owner == pid or dict:get(key) ~= owner
           or not alive(owner)
        then
            reg.owner = pid
            dict:set(key, pid)
            return { reg = reg, seg = region_at(store, r) + HEAD,
                     seg_bytes = store.seg_bytes }
        end
    end
    return nil
end


-- every record of the file: fn(kind, key, value, slot)
function _M.each(store, fn)
    for r = 0, store.regions - 1 do
        each_record(store, r, fn)
    end
end


-- appends a mark; a key longer than MAX_KEY is not kept (publisher ids
-- are shorter: the node id is at most 200 bytes)
function _M.put(w, kind, key, value)
    local klen = #key
    if klen > MAX_KEY then
        return
    end
    local reg = w.reg
    local size = band(REC + klen + 7, -8)
    local cur = reg.cur
    local fill = reg.fill[cur]
    if fill + size > w.seg_bytes then
        -- empty the older segment first, then write there
        cur = 1 - cur
        reg.fill[cur] = 0
        reg.cur = cur
        fill = 0
    end
    local p = w.seg + cur * w.seg_bytes + fill
    local rec = ffi_cast(rec_ptr, p)
    rec.size = size
    rec.kind = kind
    rec.klen = klen
    rec.value = value
    ffi_copy(p + REC, key, klen)
    rec.check = check(kind, key, value)
    -- last: a record counts once the fill covers it
    reg.fill[cur] = fill + size
end


return _M
