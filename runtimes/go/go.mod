module resty-loom

go 1.24
