std = "ngx_lua"
max_line_length = 80
unused_args = false
redefined = false
read_globals = { "coroutine._yield", "table.new", "table.clear" }
exclude_files = { "build/", "runtimes/*/target/" }

files["tests/unit/"] = { std = "+luajit" }
files["bench/"] = { globals = { "table" } }
