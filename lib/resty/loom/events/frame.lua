-- The bus's wire format. Every frame has a 16-byte header: a sequence
-- number (low half first), version, type, flags, payload length. Events
-- carry a 40-byte event header (target, publisher, pid, incarnation,
-- stream sequence, publish time, lengths)
-- followed by the unique key and the string.buffer-encoded body. Payloads
-- larger than one chunk travel as several EVENT frames with the MORE flag.
-- Frames are built in and parsed from string.buffer memory through FFI so
-- that payload bytes become Lua strings only as whole batches (cosockets
-- send and receive strings). LuaJIT hashes long strings by sampling a few
-- places, the first bytes among them: the sequence number comes first so
-- that batches of near-identical events do not collide in the string table.


local ffi = require "ffi"
local buffer = require "string.buffer"

local ffi_cast = ffi.cast
local ffi_sizeof = ffi.sizeof
local buf_new = buffer.new
local floor = math.floor


ffi.cdef [[
typedef struct {
    uint32_t  seq_lo;
    uint8_t   version;
    uint8_t   type;
    uint16_t  flags;
    uint32_t  len;
    uint32_t  seq_hi;
} loom_ev_frame_t;

typedef struct {
    int16_t   target;
    int16_t   publisher;
    uint32_t  pid;
    double    stream_seq;
    double    published_at;
    uint32_t  key_len;
    uint32_t  body_len;
    uint32_t  incarnation;
    uint32_t  reserved;
} loom_ev_event_t;
]]


local FRAME_PTR = ffi.typeof("loom_ev_frame_t *")
local EVENT_PTR = ffi.typeof("loom_ev_event_t *")
local FRAME_SIZE = ffi_sizeof("loom_ev_frame_t")
local EVENT_SIZE = ffi_sizeof("loom_ev_event_t")

local VERSION = 1
local CHUNK = 256 * 1024
local FLAG_MORE = 1
local KEY_MAX = 1024       -- longest unique key

local T_HELLO = 1
local T_WELCOME = 2
local T_EVENT = 3
local T_ACK = 4
local T_PING = 5
local T_PONG = 6
local T_REJECT = 7
local T_BYE = 8
local T_MAX = 8

-- reused scratch buffer for event bodies (the worker is single-threaded)
local body = buf_new(4096)


local _M = {
    _VERSION = "0.1.0",
    VERSION = VERSION,
    FRAME_SIZE = FRAME_SIZE,
    EVENT_SIZE = EVENT_SIZE,
    CHUNK = CHUNK,
    FLAG_MORE = FLAG_MORE,
    KEY_MAX = KEY_MAX,
    HELLO = T_HELLO,
    WELCOME = T_WELCOME,
    EVENT = T_EVENT,
    ACK = T_ACK,
    PING = T_PING,
    PONG = T_PONG,
    REJECT = T_REJECT,
    BYE = T_BYE,
    -- targets other than a worker id (>= 0); -1 is the privileged agent
    AGENT = -1,
    ALL = -2,
    OTHERS = -3,
    UNIQUE = -4,
}


local function put_header(buf, typ, flags, len, seq)
    local h = ffi_cast(FRAME_PTR, buf:reserve(FRAME_SIZE))
    h.seq_lo = seq % 4294967296
    h.version = VERSION
    h.type = typ
    h.flags = flags
    h.len = len
    h.seq_hi = floor(seq / 4294967296)
    buf:commit(FRAME_SIZE)
end
_M.put_header = put_header


-- a control frame whose payload is a string.buffer-encoded Lua value
function _M.put_control(buf, typ, seq, value)
    body:reset()
    if value ~= nil then
        body:encode(value)
    end
    local p, len = body:ref()
    put_header(buf, typ, 0, len, seq)
    buf:putcdata(p, len)
end


-- Encodes the event body into the scratch buffer and returns its length;
-- put_event() then writes it. Split so that callers can check the size
-- (and their queue bounds) before anything is queued.
function _M.encode_body(source, event, data)
    body:reset()
    body:encode(source)
    body:encode(event)
    body:encode(data)
    return #body
end


-- Appends frames carrying one payload to buf: a single frame, or CHUNK-
-- sized frames with the MORE flag on all but the last.
local function put_chunked(buf, typ, seq, p, len)
    if len <= CHUNK then
        put_header(buf, typ, 0, len, seq)
        buf:putcdata(p, len)
        return
    end
    local off = 0
    while off < len do
        local n = len - off
        local fl = 0
        if n > CHUNK then
            n = CHUNK
            fl = FLAG_MORE
        end
        put_header(buf, typ, fl, n, seq)
        buf:putcdata(p + off, n)
        off = off + n
    end
end
_M.put_chunked = put_chunked


-- Appends an event (whose body encode_body() just produced) to buf;
-- returns the number of bytes appended.
local payload = buf_new(4096)

local function fill_event(e, target, publisher, pid, incarnation, stream_seq,
                          now, key_len, body_len)
    e.target = target
    e.publisher = publisher
    e.pid = pid
    e.incarnation = incarnation
    e.reserved = 0
    e.stream_seq = stream_seq
    e.published_at = now
    e.key_len = key_len
    e.body_len = body_len
end

function _M.put_event(buf, seq, target, publisher, pid, incarnation,
                      stream_seq, now, key)
    local key_len = key and #key or 0
    local bp, body_len = body:ref()
    local len = EVENT_SIZE + key_len + body_len

    if len <= CHUNK then
        -- one frame, written in place: no intermediate copy
        put_header(buf, T_EVENT, 0, len, seq)
        fill_event(ffi_cast(EVENT_PTR, buf:reserve(EVENT_SIZE)), target,
                   publisher, pid, incarnation, stream_seq, now, key_len,
                   body_len)
        buf:commit(EVENT_SIZE)
        if key_len > 0 then
            buf:put(key)
        end
        buf:putcdata(bp, body_len)
        return FRAME_SIZE + len
    end

    payload:reset()
    fill_event(ffi_cast(EVENT_PTR, payload:reserve(EVENT_SIZE)), target,
               publisher, pid, incarnation, stream_seq, now, key_len,
               body_len)
    payload:commit(EVENT_SIZE)
    if key_len > 0 then
        payload:put(key)
    end
    payload:putcdata(bp, body_len)

    local before = #buf
    local p, plen = payload:ref()
    put_chunked(buf, T_EVENT, seq, p, plen)
    return #buf - before
end


-- Looks at the frame at the front of buf. Returns nil when it is not
-- complete yet; false, reason when the bytes are not a valid frame;
-- otherwise the header pointer, the payload pointer and the frame's size.
function _M.peek(buf, max_len)
    local p, n = buf:ref()
    if n < FRAME_SIZE then
        return nil
    end
    local h = ffi_cast(FRAME_PTR, p)
    if h.version ~= VERSION then
        return false, "bad version"
    end
    if h.type == 0 or h.type > T_MAX then
        return false, "bad type"
    end
    if h.flags > FLAG_MORE then
        return false, "bad flags"
    end
    local len = h.len
    if len > max_len then
        return false, "frame too large"
    end
    if n < FRAME_SIZE + len then
        return nil
    end
    return h, p + FRAME_SIZE, FRAME_SIZE + len
end


function _M.seq(h)
    return h.seq_hi * 4294967296 + h.seq_lo
end


-- The event header of a complete event payload, or nil and a reason when
-- its lengths do not add up (never trust a peer's lengths).
function _M.check_event(p, len)
    if len < EVENT_SIZE then
        return nil, "short event"
    end
    local e = ffi_cast(EVENT_PTR, p)
    local key_len = e.key_len
    if key_len > KEY_MAX then
        return nil, "unique key too long"
    end
    if EVENT_SIZE + key_len + e.body_len ~= len then
        return nil, "bad event lengths"
    end
    return e
end


-- Decodes a control payload (or nil for an empty one). Errors on garbage;
-- callers use pcall.
local dec = buf_new()
function _M.decode_control(p, len)
    if len == 0 then
        return nil
    end
    dec:set(p, len)
    local v = dec:decode()
    if #dec ~= 0 then
        error("trailing bytes")
    end
    return v
end


-- Decodes an event body: source, event, data. Errors on garbage.
function _M.decode_body(p, len)
    dec:set(p, len)
    local source = dec:decode()
    local event = dec:decode()
    local data = dec:decode()
    if #dec ~= 0 or type(source) ~= "string" or type(event) ~= "string" then
        error("malformed event body")
    end
    return source, event, data
end


return _M
