module resty-loom

go 1.19
