-- resty.loom.at_close: a last word when the worker closes its Lua VM.
--
-- A fast stop (SIGTERM, SIGINT, nginx -s stop) runs only
-- exit_worker_by_lua*, and nginx offers no way to see from Lua whether
-- that hook is configured. What is certain is that the worker closes its
-- Lua VM last of all (after the hook, after a graceful drain), running
-- finalizers: one on a sentinel runs the checks registered here, each of
-- which says what its module still holds that no report covered. ngx.*
-- must not be called that late (ngx.log crashes the worker): the line goes
-- to stderr, which nginx points at its error log.


local ngx = ngx
local io_stderr = io.stderr
local os_date = os.date
local concat = table.concat
local pcall = pcall
local type = type
local error = error
local newproxy = newproxy
local getmetatable = getmetatable


local _M = { _VERSION = "0.2.0" }

local checks = {}       -- in registration order
local registered = {}   -- check -> true
local sentinel          -- its finalizer runs the checks (see renew)


local function run_checks()
    for i = 1, #checks do
        local ok, level, text = pcall(checks[i])
        if ok and level then
            -- one write per line: the workers share the file
            local pid = ngx.worker.pid()
            io_stderr:write(concat({ os_date("%Y/%m/%d %H:%M:%S"), " [",
                                     level, "] ", pid, "#", pid, ": ", text,
                                     "\n" }))
        end
    end
end


local function finalize(proxy)
    -- (a sentinel that renew() replaced does nothing)
    if proxy == sentinel then
        run_checks()
    end
end


-- Makes the sentinel anew. LuaJIT finalizes the newest userdata first
-- when it closes the VM, and a string.buffer's finalizer empties it: a
-- check that reads buffers made after the sentinel would find them
-- empty. A module calls this after making such a buffer.
function _M.renew()
    local proxy = newproxy(true)
    getmetatable(proxy).__gc = finalize
    sentinel = proxy
end


-- Registers check(), run when this process closes its Lua VM. It returns
-- nothing, or an nginx log level name ("error", "warn") and the text of
-- the line to log. Registering the same check again does nothing.
function _M.register(check)
    if type(check) ~= "function" then
        error("check must be a function", 2)
    end
    if registered[check] then
        return
    end
    registered[check] = true
    checks[#checks + 1] = check
    if not sentinel then
        _M.renew()
    end
end


return _M
