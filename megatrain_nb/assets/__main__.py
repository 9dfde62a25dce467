from . import write_assets

write_assets()
