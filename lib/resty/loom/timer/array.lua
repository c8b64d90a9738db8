-- Zero-filled FFI arrays that grow without copying.
--
-- On Linux the memory is an anonymous mapping that grows with mremap(): the
-- kernel moves the pages instead of copying them, and pages are zero-filled
-- when first touched, so growing an array of n elements costs no copy and
-- no zeroing pass. Elsewhere (or when the mapping fails) a fresh ffi.new
-- array takes the old contents (ffi.new zero-fills too).
--
-- Growing may move the array: pointers into the old one are invalid at
-- once (with mremap the old pages are gone), so callers re-read the array
-- after anything that may grow it.


local ffi = require "ffi"

local C = ffi.C
local ffi_new = ffi.new
local ffi_cast = ffi.cast
local ffi_copy = ffi.copy
local ffi_gc = ffi.gc
local ceil = math.ceil


pcall(ffi.cdef, [[
void *mmap(void *addr, size_t length, int prot, int flags, int fd,
           int64_t offset);
void *mremap(void *old_address, size_t old_size, size_t new_size,
             int flags, ...);
int munmap(void *addr, size_t length);
]])
pcall(ffi.cdef, [[
typedef struct { void *p; size_t bytes; } loom_array_map_t;
]])


local PAGE = 4096
local PROT_RW = 3                   -- PROT_READ | PROT_WRITE
local MAP_PRIVATE_ANON = 0x22       -- MAP_PRIVATE | MAP_ANONYMOUS
local MREMAP_MAYMOVE = 1
local MAP_FAILED = ffi_cast("void *", -1)

local USE_MAP = ffi.os == "Linux"
    and (ffi.arch == "x64" or ffi.arch == "arm64" or ffi.arch == "x86"
         or ffi.arch == "arm")


local _M = { _VERSION = "0.2.0", mapped = USE_MAP }


local function round_up(bytes)
    return ceil(bytes / PAGE) * PAGE
end


-- a mapping's owner: its finalizer unmaps it (one function for all, so
-- that growing an array inside compiled code creates no closure)
local function unmap(m)
    C.munmap(m.p, m.bytes)
end


local function owner(p, bytes)
    return ffi_gc(ffi_new("loom_array_map_t", p, bytes), unmap)
end


-- an array object: { ptr = <ctype pointer>, n = elements, bytes = size };
-- a mapped array lives as long as the object (its owner, map, unmaps it)
-- ptr_ct: the pointer ctype ("T *"), vla_ct: the array ctype ("T[?]"),
-- size: bytes per element; plain = true: no mapping (tests)
function _M.new(ptr_ct, vla_ct, size, n, plain)
    local self = { ptr = nil, n = 0, bytes = 0, ptr_ct = ptr_ct,
                   vla_ct = vla_ct, size = size, mapped = false, map = nil }
    if USE_MAP and not plain then
        local bytes = round_up(n * size)
        local p = C.mmap(nil, bytes, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
        if p ~= MAP_FAILED then
            self.map = owner(p, bytes)
            self.ptr = ffi_cast(ptr_ct, p)
            self.bytes = bytes
            self.n = n
            self.mapped = true
            return self
        end
    end
    local a = ffi_new(vla_ct, n)
    self.keep = a                   -- the pointer does not anchor the array
    self.ptr = ffi_cast(ptr_ct, a)
    self.bytes = n * size
    self.n = n
    return self
end


-- grows to at least n elements (new ones are zero); returns the pointer,
-- which may have moved
function _M.grow(self, n)
    if n <= self.n then
        return self.ptr
    end
    local size = self.size
    if self.mapped then
        local bytes = round_up(n * size)
        local old = self.ptr
        local p = C.mremap(old, self.bytes, bytes, MREMAP_MAYMOVE)
        if p ~= MAP_FAILED then
            ffi_gc(self.map, nil)   -- the old address is gone (or reused)
            self.map = owner(p, bytes)
            self.ptr = ffi_cast(self.ptr_ct, p)
            self.bytes = bytes
            self.n = n
            return self.ptr
        end
        -- no room to move the mapping: copy into ordinary memory
        local a = ffi_new(self.vla_ct, n)
        ffi_copy(a, old, self.n * size)
        ffi_gc(self.map, nil)
        C.munmap(old, self.bytes)
        self.map = nil
        self.mapped = false
        self.keep = a
        self.ptr = ffi_cast(self.ptr_ct, a)
        self.bytes = n * size
        self.n = n
        return self.ptr
    end
    local a = ffi_new(self.vla_ct, n)
    ffi_copy(a, self.ptr, self.n * size)
    self.keep = a
    self.ptr = ffi_cast(self.ptr_ct, a)
    self.bytes = n * size
    self.n = n
    return self.ptr
end


return _M
