"""A package that is installed but fails while importing, as torchvision built for another torch does
("operator torchvision::nms does not exist"): ``bench model`` must say so in one line."""

raise RuntimeError("operator torchvision::nms does not exist")
