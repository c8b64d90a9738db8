-- resty.loom.publish.spoolfile outside nginx: records written, released
-- and read back by the next owner; garbage after the end cut, records
-- that do not check skipped, bad headers set aside; random damage never
-- makes the reader stall, loop or read past the file.

local ffi = require "ffi"

-- what spoolfile.lua takes from ngx, for plain luajit
local warnings = {}
local crc_table = {}
for i = 0, 255 do
    local c = i
    for _ = 1, 8 do
        if c % 2 == 1 then
            c = bit.bxor(bit.rshift(c, 1), 0xEDB88320)
        else
            c = bit.rshift(c, 1)
        end
    end
    crc_table[i] = c
end
local clock = os.time()
_G.ngx = {
    now = function() return clock end,
    WARN = 5,
    log = function(_, ...) warnings[#warnings + 1] = table.concat({ ... }) end,
    crc32_long = function(s)
        local c = 0xFFFFFFFF
        for i = 1, #s do
            c = bit.bxor(crc_table[bit.band(bit.bxor(c, s:byte(i)), 255)],
                         bit.rshift(c, 8))
        end
        c = bit.bxor(c, 0xFFFFFFFF)
        return c < 0 and c + 4294967296 or c
    end,
}

local file = require "resty.loom.file"
local sf = require "resty.loom.publish.spoolfile"
local crc32c = require "resty.loom.crc32c"

local n = 0
local function case(name, ok)
    n = n + 1
    if not ok then
        error("case failed: " .. name, 2)
    end
    print("ok " .. name)
end

-- CRC32C bit by bit, the definition
local function crc32c_ref(s)
    local c = 0xFFFFFFFF
    for i = 1, #s do
        c = bit.bxor(c, s:byte(i))
        for _ = 1, 8 do
            if bit.band(c, 1) ~= 0 then
                c = bit.bxor(bit.rshift(c, 1), 0x82F63B78)
            else
                c = bit.rshift(c, 1)
            end
        end
    end
    c = bit.bnot(c)
    return c < 0 and c + 4294967296 or c
end

local function crc_of(s)
    local b = ffi.new("uint8_t[?]", #s)
    ffi.copy(b, s, #s)
    return crc32c.crc32c(b, #s)
end
case("crc32c of 123456789 is e3069283", crc_of("123456789") == 0xE3069283)
do
    local ok = true
    for len = 0, 300 do
        local t = {}
        for i = 1, len do
            t[i] = string.char(math.random(0, 255))
        end
        local s = table.concat(t)
        ok = ok and crc_of(s) == crc32c_ref(s)
    end
    case("crc32c matches the definition for lengths 0 to 300", ok)
end

local dir = os.tmpname()
os.remove(dir)
assert(file.mkdirs(dir .. "/a/b", 448))
dir = dir .. "/a/b"
case("mkdirs makes the missing directories", file.writable(dir))

local function new(pid)
    return sf.new({ dir = dir, name = "proj/topic", pid = pid or 1,
                    start = os.time(), file_bytes = 65536,
                    max_bytes = 1e9, warn_interval = 0 })
end

local function msg(i)
    return ',{"data":"' .. string.rep("x", i % 300) .. i .. '"}'
end

local function files(ext)
    local out = {}
    for _, name in ipairs(file.list(dir)) do
        if name:sub(-#ext) == ext then
            out[#out + 1] = name
        end
    end
    table.sort(out)
    return out
end

-- every live record of the files adopted by a fresh reader: key .. msg
local function read_all(pid)
    local sp = new(pid)
    local got = {}
    while sf.adopt_next(sp) do
        while true do
            local p, _, len, ref = sf.next_record(sp)
            if not p then
                break
            end
            got[#got + 1] = ffi.string(p + sf.REC, len)
            sf.release(sp, ref)
        end
    end
    return got, sp
end

-- a writer with 3,000 records over several files, every third released
local w = new(1)
local refs, want = {}, {}
for i = 1, 3000 do
    local key = i % 2 == 0 and "k" .. (i % 7) or ""
    local m = msg(i)
    local buf = ffi.new("uint8_t[?]", #m)
    ffi.copy(buf, m, #m)
    refs[i] = sf.append(w, key, #key, buf, #m)
    assert(refs[i], "append")
    if i % 3 ~= 0 then
        want[#want + 1] = key .. m
    end
end
for i = 3, 3000, 3 do
    sf.release(w, refs[i])
end
case("the writer rolled to new files", #files(".spool") >= 4)
do
    -- the crc of a record is CRC32C, of its klen, key and message
    local f = w.cur
    local p = f.base + f.head       -- its first record
    local len = ffi.cast("uint32_t *", p)[0]
    case("a record's crc is the CRC32C of klen, key and message",
         ffi.cast("uint32_t *", p)[1]
         == crc32c_ref(ffi.string(p + 10, 2 + len)))
end
case("spooled counts appends", w.spooled == 3000)
sf.close(w)             -- as a dead writer leaves them: unlocked
local got, r = read_all(2)
case("a new owner reads back every live record, in order",
     table.concat(got, "\n") == table.concat(want, "\n"))
case("read and released: the files are gone", #files(".spool") == 0
     and r.bytes == 0)

-- files to damage: one writer, 500 records, then the writer gone
local function fresh()
    local sp = new(3)
    local all = {}
    for i = 1, 500 do
        local m = msg(i)
        assert(sf.append(sp, "", 0, ffi.cast("const char *", m), #m))
        all[#all + 1] = m
    end
    sf.close(sp)
    return all, files(".spool")
end

local all, names = fresh()
for _, name in ipairs(names) do
    local f = assert(io.open(dir .. "/" .. name, "ab"))
    f:write(string.rep("\255garbage", 512))
    f:close()
end
warnings = {}
got = read_all(4)
case("garbage after the end: every record still read",
     table.concat(got, "\n") == table.concat(all, "\n"))
case("... and the garbage cut with a warning",
     table.concat(warnings, "\n"):find("bytes after its end cut") ~= nil)

-- a record overwritten in the middle: that one skipped, the others read
all, names = fresh()
do
    local path = dir .. "/" .. names[1]
    local fd = assert(file.open(path, file.RDWR))
    local size = file.size(fd)
    local p = assert(file.map(fd, size, path))
    local h = ffi.cast("loom_spool_head_t *", p)
    -- the 10th record
    local off = h.head
    for _ = 1, 9 do
        off = off + bit.band(sf.REC + ffi.cast("uint32_t *", p + off)[0]
                             + 7, -8)
    end
    ffi.fill(p + off + 20, 8, 0x41)
    file.unmap(p, size)
    file.close(fd)
end
warnings = {}
got = read_all(5)
local expect = {}
for i, m in ipairs(all) do
    if i ~= 10 then
        expect[#expect + 1] = m
    end
end
case("a damaged record is skipped, every other one read",
     table.concat(got, "\n") == table.concat(expect, "\n"))
case("... with a warning",
     table.concat(warnings, "\n"):find("do not check skipped") ~= nil)

-- a header that is not ours: set aside as .bad, counted
all, names = fresh()
do
    local f = assert(io.open(dir .. "/" .. names[1], "r+b"))
    f:write("NOTSPOOL")
    f:close()
end
got, r = read_all(6)
case("a bad header: that file set aside, the next one read",
     #files(".bad") == 1 and r.errors >= 1 and #got > 0 and #got < #all
     and got[#got] == all[#all])
for _, name in ipairs(files(".bad")) do
    os.remove(dir .. "/" .. name)
end
for _, name in ipairs(files(".spool")) do
    os.remove(dir .. "/" .. name)
end

-- random damage, many times: the reader ends, reads only what was
-- written, and never past the file
math.randomseed(7)
for round = 1, 200 do
    all, names = fresh()
    local path = dir .. "/" .. names[1]
    local f = assert(io.open(path, "r+b"))
    local size = f:seek("end")
    local hits = math.random(1, 20)
    for _ = 1, hits do
        f:seek("set", math.random(round % 5 == 0 and 0 or 64, size - 1))
        local junk = {}
        for j = 1, math.random(1, 64) do
            junk[j] = string.char(math.random(0, 255))
        end
        f:write(table.concat(junk))
    end
    if round % 3 == 0 then
        f:seek("end")
        f:write(string.rep("\167", math.random(1, 9000)))
    end
    f:close()
    local set = {}
    for _, m in ipairs(all) do
        set[m] = true
    end
    got = read_all(7)
    for _, m in ipairs(got) do
        assert(set[m], "read a record that was never written")
    end
    for _, name in ipairs(files("")) do
        os.remove(dir .. "/" .. name)
    end
end
case("200 rounds of random damage: the reader always ends", true)

-- a file is written for 20 s at most (then its pages could be written
-- back to the disk while we store into them): then a new one
do
    local sp = new(9)
    local m = msg(1)
    local r1 = sf.append(sp, "", 0, ffi.cast("const char *", m), #m)
    local first = sp.cur
    clock = clock + 10
    sf.age(sp)
    local r2 = sf.append(sp, "", 0, ffi.cast("const char *", m), #m)
    case("a file of 10 s is still written", sp.cur == first)
    clock = clock + 11
    sf.age(sp)
    local r3 = sf.append(sp, "", 0, ffi.cast("const char *", m), #m)
    case("one of 21 s is left for a new one", sp.cur ~= first
         and #files(".spool") == 2)
    sf.release(sp, r1)
    case("... the old one kept while it holds a live record",
         #files(".spool") == 2)
    sf.release(sp, r2)
    case("the old one removed once done (not kept as the spare)",
         #files(".spool") == 1 and not sp.spare)
    sf.release(sp, r3)
    sf.close(sp)
    case("closed with nothing live: no file left", #files(".spool") == 0)
end

-- a .tmp file of a dead writer is cleared
do
    local t = io.open(dir .. "/" .. bit.tohex(ngx.crc32_long("proj/topic"))
                      .. "-999999999-1-1.tmp", "w")
    t:write("x")
    t:close()
    read_all(8)
    case("a dead writer's .tmp file is removed", #files(".tmp") == 0)
end

os.remove(dir)
print("ok " .. n .. " cases")
