-- Files through the FFI, for the modules that keep state in files mapped
-- into memory (cluster/marks.lua, publish/spoolfile.lua): open, lock, size,
-- allocate, map, rename, list and make directories. Failures come back as
-- nil and "failed to <what> <path>: <strerror>". Linux (64-bit).


local ffi = require "ffi"

local C = ffi.C
local ffi_cast = ffi.cast
local ffi_string = ffi.string
local ffi_errno = ffi.errno
local tonumber = tonumber
local find = string.find
local sub = string.sub


-- one declaration per call: a block stops at its first clash with another
-- module's declarations (LuaJIT takes identical function redeclarations)
for _, decl in ipairs({
    "int open(const char *path, int flags, ...);",
    "int close(int fd);",
    "long lseek(int fd, long offset, int whence);",
    "int ftruncate(int fd, long length);",
    "int unlink(const char *path);",
    "int rename(const char *from, const char *to);",
    "int mkdir(const char *path, unsigned int mode);",
    "int access(const char *path, int mode);",
    "int flock(int fd, int op);",
    "int posix_fallocate(int fd, long offset, long len);",
    "void *mmap(void *addr, size_t length, int prot, int flags, int fd, "
        .. "long offset);",
    "int munmap(void *addr, size_t length);",
    "int kill(int pid, int sig);",
    "char *strerror(int errnum);",
    "void *opendir(const char *name);",
    "void *readdir(void *dir);",
    "int closedir(void *dir);",
}) do
    pcall(ffi.cdef, decl)
end
-- struct dirent of glibc and musl on 64-bit Linux
pcall(ffi.cdef, [[
typedef struct {
    uint64_t       d_ino;
    int64_t        d_off;
    unsigned short d_reclen;
    unsigned char  d_type;
    char           d_name[256];
} loom_file_dirent_t;
]])

local O_RDWR, O_CREAT, O_EXCL, O_CLOEXEC = 2, 64, 128, 524288
local SEEK_END = 2
local PROT_RW, MAP_SHARED = 3, 1
local LOCK_EX, LOCK_NB = 2, 4
local W_OK, X_OK = 2, 1
local EEXIST, EWOULDBLOCK, ENOENT, ESRCH = 17, 11, 2, 3

local dirent_ptr = ffi.typeof("loom_file_dirent_t *")
local u8_ptr = ffi.typeof("uint8_t *")
local MAP_FAILED = ffi_cast("void *", -1)


local _M = {
    _VERSION = "0.2.0",
    RDWR = O_RDWR + O_CLOEXEC,
    CREATE = O_RDWR + O_CREAT + O_CLOEXEC,
    CREATE_NEW = O_RDWR + O_CREAT + O_EXCL + O_CLOEXEC,
    ENOENT = ENOENT,
}


local function syserr(what, path, e)
    e = e or ffi_errno()
    return "failed to " .. what .. " " .. path .. ": "
           .. ffi_string(C.strerror(e))
end
_M.syserr = syserr


-- fd, or nil, err (and the errno)
function _M.open(path, flags, mode)
    local fd = C.open(path, flags, ffi_cast("int", mode or 384))
    if fd < 0 then
        local e = ffi_errno()
        return nil, syserr("open", path, e), e
    end
    return fd
end


function _M.close(fd)
    C.close(fd)
end


-- true when this open file now holds the exclusive lock; false when
-- another one holds it; nil, err. The lock goes with the last descriptor
-- of the open file, and so with any death of its process.
function _M.lock(fd, path)
    if C.flock(fd, LOCK_EX + LOCK_NB) == 0 then
        return true
    end
    local e = ffi_errno()
    if e == EWOULDBLOCK then
        return false
    end
    return nil, syserr("lock", path, e)
end


function _M.size(fd)
    return tonumber(C.lseek(fd, 0, SEEK_END))
end


-- reserves bytes on the disk for the first `bytes` of the file: stores
-- into a mapping of them can then never fail for want of space (which
-- would be a SIGBUS)
function _M.allocate(fd, bytes, path)
    local e = C.posix_fallocate(fd, 0, bytes)
    if e ~= 0 then
        return nil, syserr("allocate " .. bytes .. " bytes for", path, e)
    end
    return true
end


function _M.truncate(fd, bytes, path)
    if C.ftruncate(fd, bytes) ~= 0 then
        return nil, syserr("truncate", path)
    end
    return true
end


-- a uint8_t pointer to the first `bytes` of the file, shared with every
-- process mapping it (and with the page cache: a store outlives the
-- process); nil, err
function _M.map(fd, bytes, path)
    local p = C.mmap(nil, bytes, PROT_RW, MAP_SHARED, fd, 0)
    if p == MAP_FAILED then
        return nil, syserr("map", path)
    end
    return ffi_cast(u8_ptr, p)
end


function _M.unmap(p, bytes)
    C.munmap(p, bytes)
end


function _M.rename(from, to)
    if C.rename(from, to) ~= 0 then
        return nil, syserr("rename", from)
    end
    return true
end


function _M.unlink(path)
    return C.unlink(path) == 0
end


-- false only when no process has this pid (ESRCH)
function _M.alive(pid)
    return C.kill(pid, 0) == 0 or ffi_errno() ~= ESRCH
end


-- makes directory `path` and the missing ones above it (mode for those it
-- makes); true, or nil, err
function _M.mkdirs(path, mode)
    local at = 1
    while true do
        local slash = find(path, "/", at + 1, true)
        local part = slash and sub(path, 1, slash - 1) or path
        if part ~= "" and C.mkdir(part, mode) ~= 0 then
            local e = ffi_errno()
            if e ~= EEXIST then
                return nil, syserr("create directory", part, e)
            end
        end
        if not slash then
            return true
        end
        at = slash
    end
end


-- true when this process may create and delete files in directory path;
-- nil, err
function _M.writable(path)
    if C.access(path, W_OK + X_OK) ~= 0 then
        return nil, syserr("write to", path)
    end
    return true
end


-- the names in directory path (without . and ..); nil, err
function _M.list(path)
    local d = C.opendir(path)
    if d == nil then
        return nil, syserr("list", path)
    end
    local names = {}
    while true do
        local e = C.readdir(d)
        if e == nil then
            break
        end
        local name = ffi_string(ffi_cast(dirent_ptr, e).d_name)
        if name ~= "." and name ~= ".." then
            names[#names + 1] = name
        end
    end
    C.closedir(d)
    return names
end


return _M
