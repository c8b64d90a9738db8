-- The files of a publisher's spool (see spool.lua for what goes in them
-- and when): their layout, the writer's appends, acknowledged records
-- marked done, and the reading of a file whose writer is gone.
--
-- <dir>/<tag>-<pid>-<start ms>-<n>.spool: tag is the crc32 of the
-- publisher's name in hex; pid and start time name the writing worker (a
-- worker id is reused by the next generation while the old one still
-- drains). The writer holds an flock on its files; any death releases it,
-- and a worker that can take it adopts the file. A file is made under a
-- .tmp name, allocated, locked and given its header, then renamed.
--
-- Layout: a 64-byte header, the publisher's name (to 8 bytes), records.
-- A record: len (u32: key and message), crc (u32), magic (u8), state (u8:
-- 0 live, 1 done), klen (u16), the ordering key, the message's JSON, zeros
-- to 8 bytes. The crc is CRC32C (as Vector's disk buffer and LevelDB's
-- log) over klen, key and message, computed on the mapped bytes without
-- making a Lua string: by the loom module with SSE4.2's crc32 instruction
-- (~0.15 us per 1.4 KB message), else by crc32c.lua. The header's fill
-- (the end of the last complete record) is stored after each record: a
-- worker killed in the middle of an append leaves the record out.


local ffi = require "ffi"
local bit = require "bit"
local file = require "resty.loom.file"
local crc32c = require "resty.loom.crc32c"

local ffi_cast = ffi.cast
local ffi_copy = ffi.copy
local ffi_string = ffi.string
local ngx_log = ngx.log
local ngx_now = ngx.now
local ngx_WARN = ngx.WARN
local crc = crc32c.crc32c
local band = bit.band
local tohex = bit.tohex
local floor = math.floor
local max = math.max
local tonumber = tonumber
local match = string.match
local sort = table.sort
local pairs = pairs

pcall(ffi.cdef, [[
typedef struct {
    char     magic[8];
    uint32_t version;
    uint32_t head;          /* where the records start */
    uint32_t cap;           /* the file's size as its writer made it */
    uint32_t fill;          /* the end of the last complete record */
    int32_t  pid;           /* the writer */
    uint32_t name_len;
    double   created;
    uint32_t seq;           /* the writer's file number */
    uint32_t reserved[5];
} loom_spool_head_t;

typedef struct {
    uint32_t len;           /* key and message */
    uint32_t crc;           /* of klen, key and message */
    uint8_t  magic;
    uint8_t  state;
    uint16_t klen;
} loom_spool_rec_t;
]])

local MAGIC = "loomspl"
local VERSION = 1
local HEAD = 64
local REC = 12              -- bytes of a record before its key
local CRC_FROM = 10         -- the crc starts at klen
local REC_MAGIC = 0xA7
local LIVE, DONE = 0, 1
local FID = 4294967296      -- a ref: file id * FID + offset
local PAGE = 4096
local NAME = "^(%x+)%-(%d+)%-(%d+)%-(%d+)%.(%l+)$"   -- tag-pid-ms-seq.ext
local RETRY = 1             -- seconds between attempts at a new file
-- A file of ours is written for at most this long (then a new one is
-- made), below the kernel's default dirty_expire (30 s): a file whose
-- pages stay dirty longer is written back to the disk while we store into
-- it, and a store into a page under writeback may wait for the disk. A
-- file deleted before that costs no disk I/O at all.
local MAX_AGE = 20

-- files made by this process: their number in its file names (two
-- publishers of one name in a worker do not collide)
local made = 0

local head_ptr = ffi.typeof("loom_spool_head_t *")
local rec_ptr = ffi.typeof("loom_spool_rec_t *")


local _M = { _VERSION = "0.2.0", REC = REC, HEAD = HEAD }


local function align8(n)
    return band(n + 7, -8)
end


local function page(n)
    return floor((n + PAGE - 1) / PAGE) * PAGE
end


-- one warning per warn_interval for the spool's trouble
local function warn(sp, ...)
    local now = ngx_now()
    if now >= sp.warn_at then
        sp.warn_at = now + sp.warn_interval
        ngx_log(ngx_WARN, "[loom.publish] ", sp.name, ": spool: ", ...)
    end
end


-- sp = new(conf): the spool files of publisher conf.name in conf.dir,
-- written by this worker (conf.pid) from conf.start on
function _M.new(conf)
    local start = floor(conf.start * 1000)
    return {
        dir = conf.dir,
        name = conf.name,
        tag = tohex(ngx.crc32_long(conf.name)),
        pid = conf.pid,
        start = start,
        file_bytes = conf.file_bytes,
        max = conf.max_bytes,
        warn_interval = conf.warn_interval,
        warn_at = 0,
        files = {},         -- id -> file
        paths = {},         -- path -> file (or false: not ours to read)
        fids = 0,
        cur = nil,          -- the file appends go to
        spare = nil,        -- an emptied file, renamed for the next one
        retry_at = 0,
        reading = {},       -- adopted files not read to their end, in order
        -- figures
        bytes = 0,          -- live records, and adopted ones not yet read
        spooled = 0,
        replayed = 0,       -- (counted by spool.lua)
        errors = 0,
    }
end


local function remove(sp, f)
    file.unlink(f.path)
    file.unmap(f.base, f.size)
    file.close(f.fd)
    sp.files[f.fid] = nil
    sp.paths[f.path] = nil
    if sp.cur == f then
        sp.cur = nil
    end
end


-- a file done with: the spare for the next one when it is one of ours of
-- the usual size, else removed
local function retire(sp, f)
    if not f.adopted and f.size == sp.file_bytes and not sp.spare
       and f.born + MAX_AGE > ngx_now()
    then
        sp.spare = f
        if sp.cur == f then
            sp.cur = nil
        end
    else
        remove(sp, f)
    end
end


local function file_name(sp, seq)
    return sp.dir .. "/" .. sp.tag .. "-" .. sp.pid .. "-" .. sp.start
           .. "-" .. seq
end


local function register(sp, f)
    local fid = sp.fids + 1
    sp.fids = fid
    f.fid = fid
    sp.files[fid] = f
    sp.paths[f.path] = f
    return f
end


local function write_head(sp, h, f)
    ffi_copy(h.magic, MAGIC, #MAGIC)
    h.version = VERSION
    h.head = f.head
    h.cap = f.size
    h.pid = sp.pid
    h.name_len = #sp.name
    h.created = sp.start / 1000
    h.seq = f.seq
    ffi_copy(ffi_cast("uint8_t *", h) + HEAD, sp.name, #sp.name)
    h.fill = f.head
end


-- a new file of `size` bytes (a multiple of the page), locked and mapped;
-- nil, err
local function create(sp, size)
    made = made + 1
    local seq = made
    local base = file_name(sp, seq)
    local tmp, path = base .. ".tmp", base .. ".spool"
    local fd, err = file.open(tmp, file.CREATE_NEW, 384)
    if not fd then
        return nil, err
    end
    local ok, p
    ok, err = file.lock(fd, tmp)
    if ok then
        ok, err = file.allocate(fd, size, tmp)
    elseif ok == false then
        err = "failed to lock " .. tmp .. ": held by another process"
    end
    if ok then
        p, err = file.map(fd, size, tmp)
    end
    if p then
        local f = { path = path, fd = fd, base = p, size = size, seq = seq,
                    born = ngx_now(),
                    head = align8(HEAD + #sp.name), live = 0,
                    sealed = false, adopted = false }
        f.fill = f.head
        f.hdr = ffi_cast(head_ptr, p)
        write_head(sp, f.hdr, f)
        ok, err = file.rename(tmp, path)
        if ok then
            return register(sp, f)
        end
        file.unmap(p, size)
    end
    file.unlink(tmp)
    file.close(fd)
    return nil, err
end


-- the file the next append of `need` bytes goes to, after the current
-- one (full) is sealed; nil when none can be had (counted, warned)
local function roll(sp, need)
    local now = ngx_now()
    local old = sp.cur
    if old then
        old.sealed = true
        sp.cur = nil
        if old.live == 0 then
            retire(sp, old)
        end
    end
    if now < sp.retry_at then
        return nil
    end
    local f = sp.spare
    if f and f.born + MAX_AGE <= now then
        sp.spare = nil
        remove(sp, f)
        f = nil
    end
    if f and f.head + need <= f.size then
        -- an emptied file of ours: renamed, its pages already there
        sp.spare = nil
        made = made + 1
        local seq = made
        local path = file_name(sp, seq) .. ".spool"
        local ok, err = file.rename(f.path, path)
        if ok then
            sp.paths[f.path] = nil
            sp.paths[path] = f
            f.path, f.seq = path, seq
            f.hdr.seq = seq
            f.fill = f.head
            f.hdr.fill = f.head
            f.sealed = false
            sp.cur = f
            return f
        end
        remove(sp, f)
        sp.errors = sp.errors + 1
        warn(sp, err, "; messages are kept in memory only for now")
    end
    local err
    f, err = create(sp, page(max(sp.file_bytes, align8(HEAD + #sp.name)
                                  + need)))
    if not f then
        sp.errors = sp.errors + 1
        sp.retry_at = now + RETRY
        warn(sp, err, "; messages are kept in memory only for now")
        return nil
    end
    sp.cur = f
    return f
end


local function put_record(f, off, key, klen, src, len, comma)
    local p = f.base + off
    local r = ffi_cast(rec_ptr, p)
    r.klen = klen
    ffi_copy(p + REC, key, klen)
    local jlen = len
    if comma then
        -- a message taken from a request body: its leading comma was cut
        p[REC + klen] = 44
        ffi_copy(p + REC + klen + 1, src, len)
        jlen = len + 1
    else
        ffi_copy(p + REC + klen, src, len)
    end
    r.len = klen + jlen
    r.crc = crc(p + CRC_FROM, 2 + klen + jlen)
    r.magic = REC_MAGIC
    r.state = LIVE
    local size = align8(REC + klen + jlen)
    -- last: the record counts once the fill covers it
    f.fill = off + size
    f.hdr.fill = off + size
    f.live = f.live + 1
    return size
end


-- writes a record to file f (from exit_file()); with comma, the message
-- at src lacks its leading comma. Returns its ref.
local function put(sp, f, key, klen, src, len, comma)
    local off = f.fill
    sp.bytes = sp.bytes + put_record(f, off, key, klen, src, len, comma)
    sp.spooled = sp.spooled + 1
    return f.fid * FID + off
end
_M.put = put


-- ref = append(sp, key, klen, src, len): writes a record of ordering key
-- `key` and the message of `len` bytes at src (with its leading comma);
-- its ref, or nil when the spool cannot take it now (warned, counted)
function _M.append(sp, key, klen, src, len)
    local f = sp.cur
    local need = align8(REC + klen + len)
    if not f or f.fill + need > f.size then
        f = roll(sp, need)
        if not f then
            return nil
        end
    end
    return put(sp, f, key, klen, src, len, false)
end


-- the bytes a record of these takes
function _M.record_bytes(klen, len)
    return align8(REC + klen + len)
end


-- a file of `bytes` for the records written at worker exit (put()); nil,
-- err
function _M.exit_file(sp, bytes)
    local f, err = create(sp, page(align8(HEAD + #sp.name) + bytes))
    if not f then
        sp.errors = sp.errors + 1
        return nil, err
    end
    f.sealed = true
    return f
end


-- the record of ref is done with (acknowledged, dropped or reported):
-- marked so, and its file retired once none of its records is live
function _M.release(sp, ref)
    local fid = floor(ref / FID)
    local f = sp.files[fid]
    if not f then
        return
    end
    local p = f.base + (ref - fid * FID)
    if p[9] == LIVE then
        p[9] = DONE
        sp.bytes = sp.bytes - align8(REC + ffi_cast(rec_ptr, p).len)
        local live = f.live - 1
        f.live = live
        if live == 0 and f.sealed then
            retire(sp, f)
        end
    end
end


-- sets a file aside as <name>.bad: it cannot be read
local function set_aside(sp, path, fd, why)
    sp.errors = sp.errors + 1
    file.rename(path, path .. ".bad")
    file.close(fd)
    ngx_log(ngx_WARN, "[loom.publish] ", sp.name, ": spool file ", path,
            " set aside as ", path, ".bad: ", why)
end


-- Takes file path when its writer is gone (its lock is free): mapped,
-- checked, appended garbage cut; true, or false when it is not ours to
-- read (locked, gone, another publisher's). Files that cannot be read
-- are set aside (counted, warned).
local function adopt(sp, path)
    local fd, err, e = file.open(path, file.RDWR)
    if not fd then
        if e ~= file.ENOENT then
            sp.errors = sp.errors + 1
            warn(sp, err)
            sp.paths[path] = false
        end
        return false
    end
    local ok
    ok, err = file.lock(fd, path)
    if not ok then
        file.close(fd)
        if ok == nil then
            sp.errors = sp.errors + 1
            warn(sp, err)
        end
        return false
    end
    local size = file.size(fd)
    if size < HEAD then
        set_aside(sp, path, fd, "shorter than its header")
        return false
    end
    local p
    p, err = file.map(fd, size, path)
    if not p then
        sp.errors = sp.errors + 1
        warn(sp, err)
        file.close(fd)
        sp.paths[path] = false
        return false
    end
    local h = ffi_cast(head_ptr, p)
    local why
    local head, cap, fill = h.head, h.cap, h.fill
    if ffi_string(h.magic, #MAGIC) ~= MAGIC or h.version ~= VERSION then
        why = "not a spool file of this version"
    elseif h.name_len ~= #sp.name or head < HEAD + h.name_len
           or fill < head or fill > cap
    then
        why = "a header that does not hold"
    elseif ffi_string(p + HEAD, h.name_len) ~= sp.name then
        -- another publisher whose name has the same crc32
        file.unmap(p, size)
        file.close(fd)
        sp.paths[path] = false
        return false
    elseif fill > size then
        why = "cut short (" .. size .. " of " .. fill .. " bytes)"
    end
    if why then
        file.unmap(p, size)
        set_aside(sp, path, fd, why)
        return false
    end
    if size > cap then
        -- something was appended after the writer's end: cut it
        file.unmap(p, size)
        sp.errors = sp.errors + 1
        ngx_log(ngx_WARN, "[loom.publish] ", sp.name, ": spool file ", path,
                ": ", size - cap, " bytes after its end cut")
        ok, err = file.truncate(fd, cap, path)
        if ok then
            p, err = file.map(fd, cap, path)
        end
        if not ok or not p then
            sp.errors = sp.errors + 1
            warn(sp, err)
            file.close(fd)
            sp.paths[path] = false
            return false
        end
        size = cap
    end
    local f = { path = path, fd = fd, base = p, size = size,
                hdr = ffi_cast(head_ptr, p), head = head, fill = fill,
                live = 0, sealed = false, adopted = true,
                cursor = head, bad = 0 }
    register(sp, f)
    sp.reading[#sp.reading + 1] = f
    sp.bytes = sp.bytes + (fill - head)
    return true
end


local function by_age(a, b)
    if a[2] ~= b[2] then
        return a[2] < b[2]
    end
    if a[3] ~= b[3] then
        return a[3] < b[3]
    end
    return a[4] < b[4]
end


-- Adopts the oldest file of the spool whose writer is gone (and clears
-- the .tmp files of dead writers); true when one was adopted.
function _M.adopt_next(sp)
    local names, err = file.list(sp.dir)
    if not names then
        sp.errors = sp.errors + 1
        warn(sp, err)
        return false
    end
    local found = {}
    local tag = sp.tag
    for i = 1, #names do
        local name = names[i]
        local t, pid, ms, seq, ext = match(name, NAME)
        if t == tag then
            local path = sp.dir .. "/" .. name
            if ext == "spool" and sp.paths[path] == nil then
                found[#found + 1] = { path, tonumber(ms), tonumber(pid),
                                      tonumber(seq) }
            elseif ext == "tmp" and not file.alive(tonumber(pid)) then
                -- a writer that died making a file
                local fd = file.open(path, file.RDWR)
                if fd then
                    if file.lock(fd, path) then
                        file.unlink(path)
                    end
                    file.close(fd)
                end
            end
        end
    end
    sort(found, by_age)
    for i = 1, #found do
        if adopt(sp, found[i][1]) then
            return true
        end
    end
    return false
end


-- The next live record of the adopted files, in order: p (its address),
-- klen, len (key and message), ref; nil when they are all read. A record
-- that does not check (torn, overwritten) is skipped: reading goes on 8
-- bytes further until one checks, and the bytes skipped are counted and
-- warned about once the file is read.
function _M.next_record(sp)
    local reading = sp.reading
    while true do
        local f = reading[1]
        if not f then
            return nil
        end
        local off, fill = f.cursor, f.fill
        while off < fill do
            local p = f.base + off
            local r = ffi_cast(rec_ptr, p)
            -- (the header first: nothing is read past the fill)
            local len = off + REC <= fill and r.len or fill
            local size = align8(REC + len)
            if off + REC + len <= fill and r.magic == REC_MAGIC
               and r.klen <= len
               and crc(p + CRC_FROM, 2 + len) == r.crc
            then
                f.cursor = off + size
                if r.state == LIVE then
                    f.live = f.live + 1
                    return p, r.klen, len, f.fid * FID + off
                end
                sp.bytes = sp.bytes - size
                off = off + size
            else
                f.bad = f.bad + 8
                sp.bytes = sp.bytes - 8
                off = off + 8
                f.cursor = off
            end
        end
        -- read to its end (a skip may have gone past it)
        sp.bytes = sp.bytes + (off - fill)
        f.cursor = fill
        table.remove(reading, 1)
        f.sealed = true
        if f.bad > 0 then
            sp.errors = sp.errors + 1
            ngx_log(ngx_WARN, "[loom.publish] ", sp.name, ": spool file ",
                    f.path, ": ", f.bad, " bytes of records that do not ",
                    "check skipped")
        end
        if f.live == 0 then
            remove(sp, f)
        end
    end
end


-- once a second: the file written to is left when it gets old (the next
-- append makes a new one), and an old spare is removed (see MAX_AGE)
function _M.age(sp)
    local now = ngx_now()
    local f = sp.cur
    if f and f.born + MAX_AGE <= now then
        f.sealed = true
        sp.cur = nil
        if f.live == 0 then
            retire(sp, f)
        end
    end
    f = sp.spare
    if f and f.born + MAX_AGE <= now then
        sp.spare = nil
        remove(sp, f)
    end
end


-- true while adopted files are not read to their end
function _M.pending(sp)
    return sp.reading[1] ~= nil
end


-- At worker exit: every file closed (its lock released for the next
-- worker); those without a live record, nor one left to read, removed.
function _M.close(sp)
    for _, f in pairs(sp.files) do
        if f.live == 0 and (not f.adopted or f.cursor >= f.fill) then
            remove(sp, f)
        else
            file.unmap(f.base, f.size)
            file.close(f.fd)
            sp.files[f.fid] = nil
        end
    end
    sp.cur, sp.spare = nil, nil
    sp.reading = {}
end


return _M
