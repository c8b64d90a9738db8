-- A small HTTP/1.1 client over cosockets: keep-alive connection pool, TLS
-- with certificate verification, connect/send/read timeouts under one limit
-- for the whole request (name resolution included), Content-Length and
-- chunked bodies. One client object per origin (scheme, host, port).


local buffer = require "string.buffer"
local semaphore = require "ngx.semaphore"
local options = require "resty.loom.opts"

local ngx_socket_tcp = ngx.socket.tcp
local ngx_now = ngx.now
local ngx_update_time = ngx.update_time
local thread_spawn = ngx.thread.spawn
local thread_kill = ngx.thread.kill
local sema_new = semaphore.new
local min = math.min
local buf_new = buffer.new
local concat = table.concat
local type = type
local tonumber = tonumber
local tostring = tostring
local pairs = pairs
local lower = string.lower
local find = string.find
local sub = string.sub
local match = string.match
local error = error
local setmetatable = setmetatable
local pcall = pcall

local DEFAULT_PORTS = { http = 80, https = 443 }
local MAX_HEADER_LINES = 200
local DEFAULT_MAX_BODY = 64 * 1024 * 1024
-- nginx takes socket timeouts up to 2^31 ms (24 days) and raises beyond
local MAX_SECONDS = 86400


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


-- "https://host:port/path?q" -> scheme, host, port, path
function _M.parse_url(url)
    if type(url) ~= "string" then
        return nil, "url must be a string"
    end
    local scheme, rest = match(url, "^(%a[%w+.-]*)://(.*)$")
    if not scheme then
        return nil, "bad url: no scheme"
    end
    scheme = lower(scheme)
    if not DEFAULT_PORTS[scheme] then
        return nil, "bad url: unsupported scheme " .. scheme
    end
    local authority, path = match(rest, "^([^/?#]*)(.*)$")
    if path == "" then
        path = "/"
    end
    local host, port
    if sub(authority, 1, 1) == "[" then
        host, port = match(authority, "^%[([^%]]+)%]:?(%d*)$")
    else
        host, port = match(authority, "^([^:]+):?(%d*)$")
    end
    if not host or host == "" then
        return nil, "bad url: no host"
    end
    port = tonumber(port) or DEFAULT_PORTS[scheme]
    if port < 1 or port > 65535 then
        return nil, "bad url: bad port"
    end
    return scheme, host, port, path
end


local SECONDS = options.above(0, MAX_SECONDS)
local NON_EMPTY = options.nonempty

-- the options of new()
local RULES = {
    url = options.test(function(v)
        return _M.parse_url(v) ~= nil
    end, "an http:// or https:// URL with a host"),
    scheme = options.one_of("http", "https"),
    host = NON_EMPTY,
    port = options.whole(1, 65535),
    ssl_verify = options.boolean,
    server_name = NON_EMPTY,
    connect_timeout = SECONDS,
    send_timeout = SECONDS,
    read_timeout = SECONDS,
    timeout = SECONDS,                  -- the whole request
    keepalive_timeout = SECONDS,
    pool_size = options.whole(1, 100000),
    max_body = options.number(0, 2^40), -- bytes
}

-- the options of request_uri()
local URI_RULES = {
    method = NON_EMPTY,
    headers = options.test(function(v)
        return type(v) == "table" or type(v) == "string"
    end, "a table or a string"),
    body = options.test(function(v)
        return type(v) == "string" or type(v) == "table"
    end, "a string or a list of strings"),
    timeout = SECONDS,
    ssl_verify = options.boolean,
    server_name = NON_EMPTY,
}


-- true for an IPv4 or IPv6 literal: connecting to it needs no resolver
local function is_ip(host)
    return find(host, ":", 1, true) ~= nil
           or match(host, "^%d+%.%d+%.%d+%.%d+$") ~= nil
end


-- opts: url or scheme/host/port; ssl_verify (default true), server_name,
-- connect_timeout, send_timeout, read_timeout (seconds, default 5),
-- timeout (the whole request, default their sum), keepalive_timeout
-- (seconds, default 60), pool_size (default 32), max_body (bytes, default
-- 64 MiB)
function _M.new(opts)
    options.check(opts, RULES, 2)
    local scheme, host, port = opts.scheme or "http", opts.host, opts.port
    if opts.url ~= nil then
        scheme, host, port = _M.parse_url(opts.url)
    end
    if host == nil then
        error("opts.host is required", 2)
    end
    port = port or DEFAULT_PORTS[scheme]
    local connect_timeout = opts.connect_timeout or 5
    local send_timeout = opts.send_timeout or 5
    local read_timeout = opts.read_timeout or 5
    local timeout = opts.timeout
                    or connect_timeout + send_timeout + read_timeout
    local ssl_verify = opts.ssl_verify
    if ssl_verify == nil then
        ssl_verify = true
    end
    local pool_size = opts.pool_size or 32
    local max_body = opts.max_body or DEFAULT_MAX_BODY
    local server_name = opts.server_name
    if server_name == nil and scheme == "https" then
        server_name = host
    end
    local host_header = host
    if port ~= DEFAULT_PORTS[scheme] then
        host_header = host .. ":" .. port
    end
    if find(host, ":", 1, true) then
        host_header = "[" .. host .. "]"
        if port ~= DEFAULT_PORTS[scheme] then
            host_header = host_header .. ":" .. port
        end
    end
    local self = {
        scheme = scheme,
        host = host,
        port = port,
        ssl = scheme == "https",
        ssl_verify = ssl_verify and true or false,
        server_name = server_name,
        host_header = host_header,
        named = not is_ip(host),
        connect_timeout = connect_timeout * 1000,
        send_timeout = send_timeout * 1000,
        read_timeout = read_timeout * 1000,
        timeout = timeout,
        keepalive_timeout = (opts.keepalive_timeout or 60) * 1000,
        pool_size = pool_size,
        max_body = max_body,
        pool_opts = { pool = concat({ scheme, host, tostring(port),
                                      server_name or "",
                                      ssl_verify and "v" or "n" }, ":") },
        -- counters
        idle = 0,           -- connections this client left in the pool
        idle_until = 0,     -- when the last of them times out there
        connects = 0,
        reuses = 0,
        requests = 0,
    }
    return setmetatable(self, mt)
end


-- milliseconds left before deadline (ngx.now() seconds)
local function left_ms(deadline)
    ngx_update_time()
    return (deadline - ngx_now()) * 1000
end


-- sets the socket's timeouts to its own, cut to what is left of the
-- request; false when nothing is left
local function arm(self, sock, deadline)
    local left = left_ms(deadline)
    if left < 1 then
        return false
    end
    sock:settimeouts(min(self.connect_timeout, left),
                     min(self.send_timeout, left),
                     min(self.read_timeout, left))
    return true
end


local function connect_in_thread(sock, host, port, opts, done, out)
    out[1], out[2] = sock:connect(host, port, opts)
    done:post(1)
end


-- Connects to a host name. nginx's resolver waits resolver_timeout (30 s
-- by default) for an answer, whatever the socket's connect timeout; the
-- connect runs in a light thread and is abandoned when the limit passes.
-- (Each light thread costs its request memory until the request ends, so
-- this is kept for connects that may resolve: see connect().)
local function connect_named(self, sock, limit_ms)
    local done = sema_new(0)
    local out = {}
    local t, err = thread_spawn(connect_in_thread, sock, self.host,
                                self.port, self.pool_opts, done, out)
    if not t then
        return nil, err
    end
    if not done:wait(limit_ms / 1000) then
        thread_kill(t)
        sock:close()
        return nil, "timeout"
    end
    return out[1], out[2]
end


-- a connect error that trying again will not cure: no resolver, or the
-- name does not exist (NXDOMAIN)
local function permanent_connect_error(err)
    return find(err, "no resolver defined", 1, true) ~= nil
           or find(err, "(3: ", 1, true) ~= nil
end


-- sock, reused or nil, err, permanent
local function connect(self, deadline)
    local sock = ngx_socket_tcp()
    if not arm(self, sock, deadline) then
        return nil, "failed to connect: timeout"
    end
    -- A name is resolved only when the pool has no idle connection: while
    -- this client left some there, connect straight away (no thread).
    local ok, err
    local pooled = self.idle
    if pooled > 0 and ngx_now() >= self.idle_until then
        pooled = 0      -- the pool's keepalive timeout closed them
        self.idle = 0
    end
    if self.named and pooled == 0 then
        ok, err = connect_named(self, sock,
                                min(self.connect_timeout, left_ms(deadline)))
    else
        ok, err = sock:connect(self.host, self.port, self.pool_opts)
    end
    if pooled > 0 then
        -- one fewer idle; none at all if the pool had none left (the
        -- server closed them)
        self.idle = (ok and sock:getreusedtimes() > 0) and pooled - 1 or 0
    end
    if not ok then
        return nil, "failed to connect: " .. err,
               permanent_connect_error(err)
    end
    local reused = sock:getreusedtimes()
    if reused == 0 then
        self.connects = self.connects + 1
        if self.ssl then
            -- lua-resty-core 0.1.25 asserts when a handshake that finished
            -- at once then failed verification: count that as a failure
            local pok, sess, herr = pcall(sock.sslhandshake, sock, nil,
                                          self.server_name, self.ssl_verify)
            if not pok then
                herr = "certificate verification failed"
                sess = nil
            end
            if not sess then
                sock:close()
                herr = tostring(herr)
                -- a certificate that does not verify (OpenSSL's "N: text",
                -- a name mismatch) will not verify on the next try either
                return nil, "failed to handshake: " .. herr,
                       find(herr, "^%d+: ") ~= nil
                       or find(herr, "certificate", 1, true) ~= nil
            end
        end

    else
        self.reuses = self.reuses + 1
    end
    return sock, reused
end


local function read_chunked(sock, max_body)
    local parts = {}
    local n, total = 0, 0
    while true do
        local line, err = sock:receive("*l")
        if not line then
            return nil, err
        end
        local size = tonumber(match(line, "^%s*(%x+)"), 16)
        if not size then
            return nil, "bad chunk size"
        end
        if size == 0 then
            -- trailers end with an empty line
            repeat
                line, err = sock:receive("*l")
                if not line then
                    return nil, err
                end
            until line == ""
            break
        end
        total = total + size
        if total > max_body then
            return nil, "body too large"
        end
        local data
        data, err = sock:receive(size)
        if not data then
            return nil, err
        end
        n = n + 1
        parts[n] = data
        line, err = sock:receive("*l")
        if not line then
            return nil, err
        end
    end
    return concat(parts, "", 1, n)
end


-- Reads one response. Returns res, keepalive_ok or nil, err, got_any.
local function read_response(sock, method, max_body)
    local line, err = sock:receive("*l")
    if not line then
        return nil, err, false
    end
    local version, status = match(line, "^HTTP/(%d%.%d) (%d%d%d)")
    if not status then
        return nil, "bad status line", true
    end
    status = tonumber(status)
    local headers = {}
    local count = 0
    while true do
        line, err = sock:receive("*l")
        if not line then
            return nil, err, true
        end
        if line == "" then
            break
        end
        count = count + 1
        if count > MAX_HEADER_LINES then
            return nil, "too many headers", true
        end
        local name, value = match(line, "^([^:]+):%s*(.-)%s*$")
        if name then
            name = lower(name)
            local old = headers[name]
            if old then
                headers[name] = old .. ", " .. value
            else
                headers[name] = value
            end
        end
    end

    local conn = headers["connection"]
    conn = conn and lower(conn) or ""
    local keepalive
    if version == "1.0" then
        keepalive = find(conn, "keep-alive", 1, true) ~= nil
    else
        keepalive = not find(conn, "close", 1, true)
    end

    local body = ""
    local bodyless = method == "HEAD" or status == 204 or status == 304
                     or (status >= 100 and status < 200)
    if bodyless then
        body = ""

    elseif headers["transfer-encoding"]
           and find(lower(headers["transfer-encoding"]), "chunked", 1, true)
    then
        body, err = read_chunked(sock, max_body)
        if not body then
            return nil, err, true
        end

    elseif headers["content-length"] then
        local len = tonumber(headers["content-length"])
        if not len or len < 0 then
            return nil, "bad content-length", true
        end
        if len > max_body then
            return nil, "body too large", true
        end
        if len > 0 then
            body, err = sock:receive(len)
            if not body then
                return nil, err, true
            end
        end

    else
        -- delimited by the end of the connection
        keepalive = false
        body, err = sock:receive("*a")
        if not body then
            return nil, err, true
        end
        if #body > max_body then
            return nil, "body too large", true
        end
    end
    return { status = status, headers = headers, body = body }, keepalive
end


local function build(self, method, path, headers, body)
    local b = buf_new(256)
    b:put(method, " ", path, " HTTP/1.1\r\nHost: ", self.host_header,
          "\r\n")
    local has_length, has_ua = false, false
    if type(headers) == "string" then
        b:put(headers)
        local lh = lower(headers)
        has_length = find(lh, "content-length:", 1, true) ~= nil
        has_ua = find(lh, "user-agent:", 1, true) ~= nil

    elseif headers then
        for k, v in pairs(headers) do
            local lk = lower(k)
            if lk == "content-length" then
                has_length = true
            elseif lk == "user-agent" then
                has_ua = true
            end
            if type(v) == "table" then
                for i = 1, #v do
                    b:put(k, ": ", v[i], "\r\n")
                end
            else
                b:put(k, ": ", v, "\r\n")
            end
        end
    end
    if not has_ua then
        b:put("User-Agent: resty-loom/", _M._VERSION, "\r\n")
    end
    local blen = 0
    if type(body) == "table" then
        for i = 1, #body do
            blen = blen + #body[i]
        end
    elseif body then
        blen = #body
    end
    if not has_length and (body or method == "POST" or method == "PUT"
                           or method == "PATCH")
    then
        b:put("Content-Length: ", blen, "\r\n")
    end
    b:put("\r\n")
    return b:tostring()
end


-- c:request(method, path, headers, body, timeout) -> res or nil, err,
-- permanent
--   timeout: seconds for the whole request (default: the client's)
--   permanent: true when trying again cannot help (no resolver, unknown
--   host, certificate not verified)
--   headers: nil, a table (name -> value or list of values) or a string of
--   ready "Name: value\r\n" lines; body: nil, a string or a list of strings.
--   res = { status = 200, headers = { ["content-type"] = ... }, body = "",
--           reused = <times the connection was reused before> }
-- A request on a reused keep-alive connection that the server had already
-- closed (nothing received back) is sent again once on a new connection.
function _M.request(self, method, path, headers, body, timeout)
    if timeout ~= nil and (type(timeout) ~= "number"
                           or not (timeout > 0 and timeout <= MAX_SECONDS))
    then
        error("timeout must be a number of seconds above 0 and at most "
              .. MAX_SECONDS, 2)
    end
    ngx_update_time()
    local deadline = ngx_now() + (timeout or self.timeout)
    local head = build(self, method, path or "/", headers, body)
    local data = head
    if type(body) == "table" then
        data = { head }
        for i = 1, #body do
            data[i + 1] = body[i]
        end
    elseif body then
        data = { head, body }
    end
    self.requests = self.requests + 1

    for attempt = 1, 2 do
        local sock, reused, permanent = connect(self, deadline)
        if not sock then
            return nil, reused, permanent
        end
        local ok, err
        if arm(self, sock, deadline) then
            ok, err = sock:send(data)
        else
            err = "timeout"
        end
        local res, keep, got_any
        if ok and not arm(self, sock, deadline) then
            ok, err = nil, "timeout"
            got_any = true      -- sent: never send it again
        end
        if ok then
            res, keep, got_any = read_response(sock, method, self.max_body)
            if not res then
                err = keep
            end
        end
        if res then
            if keep then
                if sock:setkeepalive(self.keepalive_timeout,
                                     self.pool_size)
                   and self.idle < self.pool_size
                then
                    self.idle = self.idle + 1
                    self.idle_until = ngx_now()
                                      + self.keepalive_timeout / 1000
                end
            else
                sock:close()
            end
            res.reused = reused
            return res
        end
        sock:close()
        if reused == 0 or attempt == 2 or got_any
           or (err ~= "closed" and not find(err, "reset", 1, true)
               and not find(err, "broken pipe", 1, true))
        then
            if ok or got_any then
                return nil, "failed to read response: " .. err
            end
            return nil, "failed to send request: " .. err
        end
        -- stale keep-alive connection: try once more on a fresh one
    end
end


-- one-shot helper: http.request_uri("https://h/p", { method = "POST",
-- headers = ..., body = ..., ssl_verify = ..., timeout = ... })
function _M.request_uri(url, params)
    params = params or {}
    options.check(params, URI_RULES, 2)
    local scheme, host, port, path = _M.parse_url(url)
    if not scheme then
        return nil, host
    end
    local t = params.timeout
    local c = _M.new({
        scheme = scheme, host = host, port = port,
        ssl_verify = params.ssl_verify,
        server_name = params.server_name,
        connect_timeout = t, send_timeout = t, read_timeout = t,
        timeout = t,
    })
    return c:request(params.method or "GET", path, params.headers,
                     params.body)
end


return _M
