"""A tiny single-stage detector with hand-written NMS in ``forward``, as early YOLO/SSD research repos write it
(the ``py_cpu_nms`` of py-faster-rcnn ported to torch): conv backbone and head with BatchNorm2d, box decoding,
then ``while order.numel() > 0: i = order[0]; keep.append(i); ...; order = order[1:][iou <= thr]`` per image.
"""
import torch
import torch.nn.functional as F
from torch import nn

IMG, STRIDE = 32, 4
GRID = IMG // STRIDE


class ConvBN(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.leaky_relu(self.bn(self.conv(x)), 0.1)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.Sequential(ConvBN(3, 32, 2), ConvBN(32, 64, 2), ConvBN(64, 64))

    def forward(self, images):
        return self.stages(images)


class Head(nn.Module):
    """Per cell: an objectness logit and (tx, ty, tw, th)."""

    def __init__(self):
        super().__init__()
        self.conv = ConvBN(64, 64)
        self.pred = nn.Conv2d(64, 5, 1)

    def forward(self, feats):
        out = self.pred(self.conv(feats)).flatten(2).transpose(1, 2)  # [B, cells, 5]
        return out[..., 0], out[..., 1:]


def nms(boxes, scores, iou_thr):
    """Greedy NMS on xyxy boxes; the indices kept, best first."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    areas = (x2 - x1) * (y2 - y1)
    order = scores.argsort(descending=True)
    keep = []
    while order.numel() > 0:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        xx1 = torch.maximum(x1[i], x1[rest])
        yy1 = torch.maximum(y1[i], y1[rest])
        xx2 = torch.minimum(x2[i], x2[rest])
        yy2 = torch.minimum(y2[i], y2[rest])
        inter = (xx2 - xx1).clamp(min=0) * (yy2 - yy1).clamp(min=0)
        iou = inter / (areas[i] + areas[rest] - inter)
        order = rest[iou <= iou_thr]
    return torch.stack(keep) if keep else order


class TinyDetector(nn.Module):
    def __init__(self, score_thr=0.3, iou_thr=0.45, pre_nms=32, max_det=32):
        super().__init__()
        self.backbone = Backbone()
        self.head = Head()
        ys, xs = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
        self.register_buffer("grid", torch.stack([xs, ys], -1).view(-1, 2).float(), persistent=False)
        self.score_thr, self.iou_thr, self.pre_nms, self.max_det = score_thr, iou_thr, pre_nms, max_det

    def decode(self, deltas):
        centers = (self.grid + deltas[..., :2].sigmoid()) * STRIDE
        sizes = deltas[..., 2:].clamp(max=3).exp() * STRIDE * 3
        return torch.cat([centers - sizes / 2, centers + sizes / 2], dim=-1)

    def forward(self, images):
        objectness, deltas = self.head(self.backbone(images))
        boxes = self.decode(deltas.float())
        scores = objectness.float().sigmoid()
        kept_scores, kept_boxes = [], []
        for b in range(images.shape[0]):
            s, bx = scores[b], boxes[b]
            candidates = (s > self.score_thr).nonzero().squeeze(1)
            candidates = candidates[s[candidates].argsort(descending=True)[: self.pre_nms]]
            s, bx = s[candidates], bx[candidates]
            with torch.no_grad():
                keep = nms(bx, s, self.iou_thr)[: self.max_det]
            kept_scores.append(s[keep])
            kept_boxes.append(bx[keep])
        return {"scores": torch.cat(kept_scores), "boxes": torch.cat(kept_boxes),
                "objectness": objectness, "deltas": deltas}


def _batch(gen, batch=2):
    """Images with 1-3 bright squares; targets: objectness per cell and the squares' encoded boxes."""
    images = torch.randn(batch, 3, IMG, IMG, generator=gen) * 0.1
    target_obj = torch.zeros(batch, GRID * GRID)
    target_deltas = torch.zeros(batch, GRID * GRID, 4)
    for b in range(batch):
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            size = int(torch.randint(4, 12, (1,), generator=gen))
            x0, y0 = torch.randint(0, IMG - size, (2,), generator=gen).tolist()
            images[b, :, y0:y0 + size, x0:x0 + size] += 1.0
            cx, cy = x0 + size / 2, y0 + size / 2
            cell = int(cy // STRIDE) * GRID + int(cx // STRIDE)
            target_obj[b, cell] = 1.0
            offset = torch.tensor([cx / STRIDE % 1, cy / STRIDE % 1]).clamp(0.05, 0.95)
            target_deltas[b, cell, :2] = torch.logit(offset)
            target_deltas[b, cell, 2:] = torch.tensor(size / (STRIDE * 3)).log()
    return images, target_obj, target_deltas


def build_model():
    torch.manual_seed(0)
    return TinyDetector()


def example_inputs():
    images, _, _ = _batch(torch.Generator().manual_seed(1))
    return (images,)


def loss_fn(output, batch):
    _, target_obj, target_deltas = batch
    objectness = output["objectness"].float()
    positive = target_obj > 0
    obj_loss = F.binary_cross_entropy_with_logits(objectness, target_obj)
    box_loss = F.smooth_l1_loss(output["deltas"].float()[positive], target_deltas[positive]) if positive.any() else 0.0
    return obj_loss + box_loss


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        images, target_obj, target_deltas = _batch(gen)
        yield (images,), (images, target_obj, target_deltas)
