-- RS256 JSON Web Tokens signed with OpenSSL's libcrypto through the FFI.
-- nginx already links libcrypto, so its symbols resolve in ffi.C; plain
-- LuaJIT falls back to loading libcrypto by name.


local ffi = require "ffi"
local cjson = require "cjson.safe"

local C = ffi.C
local ffi_new = ffi.new
local ffi_gc = ffi.gc
local ffi_str = ffi.string
local json_encode = cjson.encode
local encode_base64 = ngx.encode_base64
local gsub = string.gsub
local type = type
local error = error
local pcall = pcall
local setmetatable = setmetatable

ffi.cdef [[
typedef struct bio_st BIO;
typedef struct evp_pkey_st EVP_PKEY;
typedef struct evp_md_ctx_st EVP_MD_CTX;
typedef struct evp_md_st EVP_MD;
typedef struct evp_pkey_ctx_st EVP_PKEY_CTX;
typedef struct engine_st ENGINE;

BIO *BIO_new_mem_buf(const void *buf, int len);
int BIO_free(BIO *a);
EVP_PKEY *PEM_read_bio_PrivateKey(BIO *bp, EVP_PKEY **x, void *cb, void *u);
void EVP_PKEY_free(EVP_PKEY *pkey);
EVP_MD_CTX *EVP_MD_CTX_new(void);
void EVP_MD_CTX_free(EVP_MD_CTX *ctx);
const EVP_MD *EVP_sha256(void);
int EVP_DigestSignInit(EVP_MD_CTX *ctx, EVP_PKEY_CTX **pctx,
                       const EVP_MD *type, ENGINE *e, EVP_PKEY *pkey);
int EVP_DigestSign(EVP_MD_CTX *ctx, unsigned char *sigret, size_t *siglen,
                   const unsigned char *tbs, size_t tbslen);
unsigned long ERR_get_error(void);
void ERR_error_string_n(unsigned long e, char *buf, size_t len);
void ERR_clear_error(void);
]]

local crypto
do
    local ok = pcall(function() return C.EVP_MD_CTX_new end)
    if ok then
        crypto = C
    else
        for _, name in ipairs({ "crypto", "libcrypto.so.3",
                                "libcrypto.so.1.1" })
        do
            local lok, lib = pcall(ffi.load, name)
            if lok then
                crypto = lib
                break
            end
        end
    end
end


local function ssl_error(what)
    local msg = "unknown error"
    if crypto then
        local code = crypto.ERR_get_error()
        if code ~= 0 then
            local buf = ffi_new("char[256]")
            crypto.ERR_error_string_n(code, buf, 256)
            msg = ffi_str(buf)
        end
        crypto.ERR_clear_error()
    end
    return "failed to " .. what .. ": " .. msg
end


local function b64url(s)
    local out = encode_base64(s, true)
    out = gsub(out, "[+/]", { ["+"] = "-", ["/"] = "_" })
    return out
end


local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

_M.base64url = b64url


-- signer, err = jwt.new(pem): loads an RSA private key in PEM (PKCS#8 or
-- PKCS#1)
function _M.new(pem)
    if type(pem) ~= "string" or pem == "" then
        error("pem must be a non-empty string", 2)
    end
    if not crypto then
        return nil, "failed to load key: libcrypto not found"
    end
    local bio = crypto.BIO_new_mem_buf(pem, #pem)
    if bio == nil then
        return nil, ssl_error("load key")
    end
    local pkey = crypto.PEM_read_bio_PrivateKey(bio, nil, nil, nil)
    crypto.BIO_free(bio)
    if pkey == nil then
        return nil, ssl_error("load key")
    end
    local self = {
        pkey = ffi_gc(pkey, crypto.EVP_PKEY_free),
        siglen = ffi_new("size_t[1]"),
    }
    return setmetatable(self, mt)
end


-- signature, err = signer:sign(data): RSASSA-PKCS1-v1_5 with SHA-256
function _M.sign(self, data)
    local ctx = crypto.EVP_MD_CTX_new()
    if ctx == nil then
        return nil, ssl_error("sign")
    end
    ctx = ffi_gc(ctx, crypto.EVP_MD_CTX_free)
    if crypto.EVP_DigestSignInit(ctx, nil, crypto.EVP_sha256(), nil,
                                 self.pkey) ~= 1
    then
        return nil, ssl_error("sign")
    end
    local siglen = self.siglen
    if crypto.EVP_DigestSign(ctx, nil, siglen, data, #data) ~= 1 then
        return nil, ssl_error("sign")
    end
    local sig = ffi_new("unsigned char[?]", siglen[0])
    if crypto.EVP_DigestSign(ctx, sig, siglen, data, #data) ~= 1 then
        return nil, ssl_error("sign")
    end
    return ffi_str(sig, siglen[0])
end


-- token, err = signer:encode(claims, header_extra): a compact RS256 JWT;
-- header_extra may add fields such as kid
function _M.encode(self, claims, header_extra)
    local header = { alg = "RS256", typ = "JWT" }
    if header_extra then
        for k, v in pairs(header_extra) do
            header[k] = v
        end
    end
    local h, err = json_encode(header)
    if not h then
        return nil, "failed to encode header: " .. err
    end
    local c
    c, err = json_encode(claims)
    if not c then
        return nil, "failed to encode claims: " .. err
    end
    local input = b64url(h) .. "." .. b64url(c)
    local sig
    sig, err = self:sign(input)
    if not sig then
        return nil, err
    end
    return input .. "." .. b64url(sig)
end


return _M
