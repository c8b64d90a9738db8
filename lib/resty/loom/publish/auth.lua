-- Credentials for resty.loom.publish: Google service-account keys (OAuth
-- JWT-bearer exchange or self-signed JWT), the GCE metadata server, a static
-- token, or none (emulator). Tokens are cached until they expire in a shared
-- dict when one is given, refreshed well before they expire by one worker at
-- a time (a shm lock), and shared by every topic that uses the same
-- credentials.


local cjson = require "cjson.safe"
local http = require "resty.loom.http"
local jwt = require "resty.loom.jwt"
local options = require "resty.loom.opts"

local ngx_now = ngx.now
local ngx_sleep = ngx.sleep
local ngx_log = ngx.log
local ngx_WARN = ngx.WARN
local ngx_ERR = ngx.ERR
local ngx_md5 = ngx.md5
local escape_uri = ngx.escape_uri
local timer_at = ngx.timer.at
local worker_exiting = ngx.worker.exiting
local json_decode = cjson.decode
local type = type
local concat = table.concat
local tostring = tostring
local floor = math.floor
local ceil = math.ceil
local io_open = io.open
local error = error
local setmetatable = setmetatable

local LOG_TAG = "[loom.publish] "
local DEFAULT_SCOPES = { "https://www.googleapis.com/auth/pubsub" }
local DEFAULT_TOKEN_URI = "https://oauth2.googleapis.com/token"
local SELF_SIGNED_AUD = "https://pubsub.googleapis.com/"
local METADATA_PATH =
    "/computeMetadata/v1/instance/service-accounts/default/token"
local DEFAULT_METADATA_HOST = "169.254.169.254"
local JWT_LIFETIME = 3600
local LOCK_TTL = 30
local WAIT_STEP = 0.02
local REFUSED_WAIT = 5

-- one credential object per worker per identity, shared by all publishers
local registry = {}


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }


local function read_file(path)
    local f, err = io_open(path, "rb")
    if not f then
        return nil, err
    end
    local data = f:read("*a")
    f:close()
    return data
end


-- the key of opts.key or opts.key_file, checked; raises at level (counted
-- from this function's caller) naming the option as label.key(_file)
local function load_key(opts, label, level)
    level = level + 1
    local key = opts.key
    local name = label .. ".key"
    if key == nil and opts.key_file ~= nil then
        name = label .. ".key_file"
        local data, err = read_file(opts.key_file)
        if not data then
            error(name .. " must be a readable file (" .. err .. ")", level)
        end
        key = data
    end
    if key == nil then
        error(label .. ".key or " .. label .. ".key_file is required", level)
    end
    local what = name .. " must be a service-account key "
    if type(key) == "string" then
        local t = json_decode(key)
        if type(t) ~= "table" then
            error(what .. "(not valid JSON)", level)
        end
        key = t
    end
    if type(key.client_email) ~= "string"
       or type(key.private_key) ~= "string"
    then
        error(what .. "(it needs client_email and private_key)", level)
    end
    return key, what
end


local is_text = options.is_nonempty
local TEXT = options.nonempty
local SECONDS = options.above(0, 86400)

-- every option of the credentials table
local RULES = {
    type = options.one_of("service_account", "metadata", "token", "none"),
    key = options.test(function(v)
        return type(v) == "table" or is_text(v)
    end, "a table or a non-empty string (the key's JSON)"),
    key_file = TEXT,
    self_signed_jwt = options.boolean,
    scopes = options.test(function(v)
        return type(v) == "table" or is_text(v)
    end, "a non-empty string or a table"),
    token_uri = TEXT,
    metadata_host = TEXT,
    token = TEXT,
    shm = TEXT,
    refresh_margin = SECONDS,
    timeout = SECONDS,
    ssl_verify = options.boolean,
    audience = TEXT,
}


-- raises unless every key of opts is a credentials option with a good
-- value and the table says which credentials it is; path names the table
-- ("opts.credentials"), level as error()'s, counted from the caller
local function check(opts, path, level)
    options.check(opts, RULES, level + 1, path)
    if opts.type == nil and opts.key == nil and opts.key_file == nil
       and opts.token == nil
    then
        error(path .. " must be a table with key, key_file, token or type",
              level + 1)
    end
end


-- Fetches a fresh token: returns token, lifetime (seconds) or nil, err,
-- permanent (true when asking again cannot help: the endpoint refused the
-- credentials, or cannot be reached for good)
local function fetch(self)
    local kind = self.kind
    if kind == "self_signed" then
        local now = floor(ngx_now())
        local tok, err = self.signer:encode({
            iss = self.email, sub = self.email, aud = self.audience,
            iat = now, exp = now + JWT_LIFETIME,
        }, self.kid and { kid = self.kid } or nil)
        if not tok then
            return nil, err
        end
        return tok, JWT_LIFETIME
    end

    local res, err, permanent
    if kind == "service_account" then
        local now = floor(ngx_now())
        local assertion
        assertion, err = self.signer:encode({
            iss = self.email, scope = self.scope, aud = self.token_uri,
            iat = now, exp = now + JWT_LIFETIME,
        }, self.kid and { kid = self.kid } or nil)
        if not assertion then
            return nil, err
        end
        res, err, permanent = self.client:request("POST", self.token_path, {
            ["Content-Type"] = "application/x-www-form-urlencoded",
            ["Accept"] = "application/json",
        }, "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer"
           .. "&assertion=" .. escape_uri(assertion))

    else -- metadata
        res, err, permanent = self.client:request("GET", self.token_path, {
            ["Metadata-Flavor"] = "Google",
            ["Accept"] = "application/json",
        })
    end
    if not res then
        return nil, "failed to fetch token: " .. err, permanent
    end
    local body = json_decode(res.body)
    if res.status ~= 200 then
        local reason = type(body) == "table"
                       and (body.error_description or body.error)
        local status = res.status
        return nil, "failed to fetch token: status " .. status
                    .. (type(reason) == "string" and (": " .. reason) or ""),
               status >= 400 and status < 500 and status ~= 408
               and status ~= 429
    end
    if type(body) ~= "table" or type(body.access_token) ~= "string"
       or body.access_token == ""
    then
        return nil, "failed to fetch token: bad response"
    end
    local ttl = tonumber(body.expires_in) or 3600
    return body.access_token, ttl
end


-- Refreshes under the lock; returns token or nil, err, permanent. Caller
-- holds no lock.
local function refresh(self)
    local shm = self.shm
    local key = self.key
    -- a refusal (bad key, revoked account) stands for a while: publishing
    -- must not ask the token endpoint again for every batch
    if self.refused_until and ngx_now() < self.refused_until then
        return nil, self.refused, true
    end
    if shm then
        local ok = shm:add(self.lock_key, ngx.worker.pid(), LOCK_TTL)
        if not ok then
            return nil, "busy"
        end
    elseif self.refreshing then
        return nil, "busy"
    end
    if shm then
        -- another worker may have refreshed while we were deciding
        local cur, refresh_at = shm:get(key)
        if cur and ngx_now() < refresh_at then
            shm:delete(self.lock_key)
            self.token = cur
            self.refresh_at = refresh_at
            return cur
        end
    end
    self.refreshing = true
    local tok, ttl, permanent = fetch(self)
    self.refreshing = false
    if not tok then
        if shm then
            shm:delete(self.lock_key)
        end
        self.failures = self.failures + 1
        if permanent then
            self.refused = ttl
            self.refused_until = ngx_now() + REFUSED_WAIT
        end
        return nil, ttl, permanent
    end
    local now = ngx_now()
    -- refresh when the margin is left; a token living less than twice the
    -- margin (the metadata server hands out its cached one) is renewed at
    -- half-life, so that it does not make every call refresh
    local refresh_at = ceil(now + math.max(ttl - self.margin, ttl / 2))
    self.refreshes = self.refreshes + 1
    if shm then
        -- the entry expires with the token; the refresh time rides in the
        -- flags (unix seconds fit 32 bits)
        local ok, err = shm:set(key, tok, math.max(ttl - 1, 0.5),
                                refresh_at)
        if not ok then
            ngx_log(ngx_ERR, LOG_TAG, "failed to store token: ", err)
        end
        shm:incr(self.count_key, 1, 0)
        shm:delete(self.lock_key)
    end
    self.token = tok
    self.refresh_at = refresh_at
    self.expiry = now + ttl - 1
    return tok
end


-- token, refresh_at: a token that has not expired, and when to renew it
local function cached(self)
    local shm = self.shm
    if shm then
        local tok, refresh_at = shm:get(self.key)
        if tok then
            self.token = tok
            self.refresh_at = refresh_at
            return tok, refresh_at
        end
        return nil
    end
    local tok = self.token
    if tok and ngx_now() < self.expiry then
        return tok, self.refresh_at
    end
    return nil
end


-- token, err, permanent = cred:get(timeout): a valid token (nil for kind
-- "none"); may yield: call it from a timer or a yieldable phase
function _M.get(self, timeout)
    local kind = self.kind
    if kind == "none" then
        return nil
    end
    if kind == "static" then
        return self.token
    end
    local deadline = ngx_now() + (timeout or 10)
    local step = WAIT_STEP
    while true do
        local tok, refresh_at = cached(self)
        local now = ngx_now()
        if tok and now < refresh_at then
            return tok
        end
        local fresh, err, permanent = refresh(self)
        if fresh then
            return fresh
        end
        if tok then
            -- someone else is refreshing, or it failed: the old one is
            -- still good for now
            return tok
        end
        if err ~= "busy" then
            return nil, err, permanent
        end
        if now >= deadline then
            return nil, "failed to get token: timeout"
        end
        ngx_sleep(step)
        if step < 0.2 then
            step = step * 2
        end
    end
end


-- cred:invalidate(token): the server rejected this token (401); the next
-- get() fetches a new one (unless another worker already has)
function _M.invalidate(self, tok)
    if not tok or self.kind == "static" or self.kind == "none" then
        return
    end
    if self.shm then
        local cur = self.shm:get(self.key)
        if cur == tok then
            self.shm:delete(self.key)
        end
    end
    if self.token == tok then
        self.token = nil
        self.refresh_at = nil
        self.expiry = nil
    end
end


-- number of refreshes: across workers when a shared dict is used
function _M.refresh_count(self)
    if self.shm then
        return self.shm:get(self.count_key) or 0
    end
    return self.refreshes
end


local function refresher(premature, self)
    if premature or worker_exiting() then
        return
    end
    local tok, refresh_at = cached(self)
    if not tok or ngx_now() >= refresh_at then
        local ok, err = refresh(self)
        if not ok and err ~= "busy" then
            ngx_log(ngx_WARN, LOG_TAG, "token refresh: ", err)
        end
    end
    local ok, err = timer_at(self.check_interval, refresher, self)
    if not ok and not worker_exiting() then
        ngx_log(ngx_ERR, LOG_TAG, "failed to schedule refresher: ", err)
    end
end


-- starts this worker's background refresher (once per credential)
function _M.start(self)
    if self.started or self.kind == "none" or self.kind == "static" then
        return true
    end
    local ok, err = timer_at(0, refresher, self)
    if not ok then
        return nil, "failed to start refresher: " .. err
    end
    self.started = true
    return true
end


-- cred = auth.new(opts, label, level) (raises on bad options, naming them
-- as label.<option>, "credentials" by default, at level as error()'s,
-- counted from the caller: 1 by default)
--   opts.type: "service_account" (default when key/key_file is given),
--     "metadata", "token", "none"
--   opts.key / opts.key_file: the JSON key (table, string or file path)
--   opts.self_signed_jwt: sign tokens locally (aud
--     https://pubsub.googleapis.com/), no token exchange
--   opts.scopes, opts.token_uri, opts.metadata_host, opts.token,
--   opts.shm (lua_shared_dict name), opts.refresh_margin (300 s),
--   opts.timeout (10 s), opts.ssl_verify (true), opts.audience
function _M.new(opts, label, level)
    label = label or "credentials"
    level = (level or 1) + 1
    check(opts, label, level)
    local kind = opts.type
    if kind == nil then
        if opts.key ~= nil or opts.key_file ~= nil then
            kind = "service_account"
        else
            kind = "token"
        end
    end
    if kind == "service_account" and opts.self_signed_jwt then
        kind = "self_signed"
    end

    local self = {
        kind = kind,
        margin = opts.refresh_margin or 300,
        refreshes = 0,
        failures = 0,
        started = false,
        refreshing = false,
    }
    local timeout = opts.timeout or 10
    local identity

    if kind == "none" then
        identity = "none"

    elseif kind == "token" then
        if opts.token == nil then
            error(label .. ".token is required", level)
        end
        self.kind = "static"
        self.token = opts.token
        return setmetatable(self, mt)

    elseif kind == "service_account" or kind == "self_signed" then
        local key, what = load_key(opts, label, level)
        local signer, err = jwt.new(key.private_key)
        if not signer then
            error(what .. "(private_key: " .. err .. ")", level)
        end
        self.signer = signer
        self.email = key.client_email
        self.kid = key.private_key_id
        local scopes = opts.scopes or DEFAULT_SCOPES
        if type(scopes) == "string" then
            scopes = { scopes }
        end
        self.scope = concat(scopes, " ")
        if kind == "self_signed" then
            self.audience = opts.audience or SELF_SIGNED_AUD
            identity = "jwt:" .. self.email .. ":" .. self.audience
        else
            local uri = opts.token_uri or key.token_uri or DEFAULT_TOKEN_URI
            local scheme, host, port, path = http.parse_url(uri)
            if not scheme then
                if opts.token_uri then
                    error(label .. ".token_uri must be an http or https URL ("
                          .. host .. ")", level)
                end
                error(what .. "(token_uri: " .. host .. ")", level)
            end
            self.token_uri = uri
            self.token_path = path
            self.client = http.new({
                scheme = scheme, host = host, port = port,
                ssl_verify = opts.ssl_verify,
                connect_timeout = timeout, send_timeout = timeout,
                read_timeout = timeout, pool_size = 4,
            })
            identity = "sa:" .. self.email .. ":" .. self.scope .. ":" .. uri
        end

    elseif kind == "metadata" then
        local host = opts.metadata_host or os.getenv("GCE_METADATA_HOST")
                     or DEFAULT_METADATA_HOST
        local h, port = host:match("^([^:]+):?(%d*)$")
        if not h then
            error((opts.metadata_host and label .. ".metadata_host"
                   or "GCE_METADATA_HOST") .. " must be host[:port]", level)
        end
        local path = METADATA_PATH
        if opts.scopes then
            local scopes = opts.scopes
            if type(scopes) == "string" then
                scopes = { scopes }
            end
            path = path .. "?scopes=" .. escape_uri(concat(scopes, ","))
        end
        self.token_path = path
        self.client = http.new({
            scheme = "http", host = h, port = tonumber(port) or 80,
            connect_timeout = timeout, send_timeout = timeout,
            read_timeout = timeout, pool_size = 4,
        })
        identity = "md:" .. host .. path
    end

    local shm_name = opts.shm
    if shm_name ~= nil then
        local shm = ngx.shared[shm_name]
        if not shm then
            error(label .. ".shm must be the name of a lua_shared_dict (none "
                  .. "is called " .. shm_name .. ")", level)
        end
        self.shm = shm
    end
    local reg_key = identity .. "|" .. tostring(shm_name) .. "|"
                    .. self.margin
    local existing = registry[reg_key]
    if existing then
        return existing
    end
    local id = ngx_md5(identity)
    self.key = "loom:tok:" .. id
    self.lock_key = "loom:lock:" .. id
    self.count_key = "loom:refreshes:" .. id
    self.check_interval = math.max(0.5, math.min(30, self.margin / 3))
    setmetatable(self, mt)
    registry[reg_key] = self
    return self
end


-- auth.check(opts, path, level): the checks of new(), without making
-- anything; level as error()'s, counted from the caller
function _M.check(opts, path, level)
    check(opts, path or "credentials", (level or 1) + 1)
end


return _M
