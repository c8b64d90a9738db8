-- The function ngx.run_worker_thread runs in the benchmark.
local _M = {}

function _M.echo(s)
    return s
end

return _M
