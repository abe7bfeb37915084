{{/* A worker Deployment (prefill or decode pods). dict: root, role */}}
{{- define "tandem.workerDeployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.labels" $ctx | trim | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $ctx | trim | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" $ctx | trim | nindent 8 }}
      annotations:
        checksum/engine: {{ include "tandem.engineConfig" $root | sha256sum }}
        {{- with merge (dict) $v.podAnnotations $root.Values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "tandem.podCommon" $root | trim | nindent 6 }}
      {{- with include "tandem.scheduling" $v | trim }}{{ . | nindent 6 }}{{ end }}
      terminationGracePeriodSeconds: {{ include "tandem.terminationGrace" $v }}
      {{- with include "tandem.initContainers" (dict "root" $root "kernels" true) | trim }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        {{- include "tandem.workerContainer" (dict "root" $root "role" $role) | trim | nindent 8 }}
      volumes:
        {{- include "tandem.volumes" (dict "root" $root "role" $role "shmSize" $v.shmSize) | trim | nindent 8 }}
{{- end }}

{{/* The engine ConfigMap's data: engine and drafter settings of each worker role. */}}
{{- define "tandem.engineConfig" -}}
{{- $root := . }}
{{- range $role := list "prefill" "decode" }}
{{- $v := index $root.Values $role }}
{{ $role }}.dtype: {{ $root.Values.engine.dtype | quote }}
{{ $role }}.block-size: {{ $root.Values.engine.blockSize | quote }}
{{ $role }}.max-num-seqs: {{ $v.engine.maxNumSeqs | quote }}
{{- with $root.Values.engine.maxModelLen }}
{{ $role }}.max-model-len: {{ . | quote }}
{{- end }}
{{- with $v.engine.kvCacheMemory }}
{{ $role }}.kv-cache-memory: {{ . | int64 | quote }}
{{- end }}
{{- with $v.engine.threads }}
{{ $role }}.threads: {{ . | quote }}
{{- end }}
{{- if gt (int $v.engine.tensorParallelSize) 1 }}
{{ $role }}.tensor-parallel-size: {{ $v.engine.tensorParallelSize | quote }}
{{- end }}
{{- if gt (int $v.engine.dataParallelSize) 1 }}
{{ $role }}.data-parallel-size: {{ $v.engine.dataParallelSize | quote }}
{{- end }}
{{- if $v.draft.enabled }}
{{ $role }}.draft: {{ include "tandem.draftPath" $root | quote }}
{{- end }}
{{- if or $v.draft.enabled $v.draft.method }}
{{ $role }}.num-draft-tokens: {{ $v.draft.numDraftTokens | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A HorizontalPodAutoscaler. dict: root, component, autoscaling */}}
{{- define "tandem.hpa" -}}
{{- $a := .autoscaling }}
{{- if $a.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.labels" . | trim | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "tandem.componentName" . }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- with $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.targetMemoryUtilizationPercentage }}
    - type: Resource
      resource:
        name: memory
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.metrics }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget. dict: root, component, pdb */}}
{{- define "tandem.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.componentName" . }}
  labels:
    {{- include "tandem.labels" . | trim | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | trim | nindent 6 }}
{{- end }}
{{- end }}

{{/* The headless Service of a worker role: one DNS record per ready pod (discovery itself
goes through the ledger: each worker registers its pod IP). dict: root, role */}}
{{- define "tandem.workerService" -}}
{{- $v := index .root.Values .role }}
{{- $pods := ternary "worker" .role .root.Values.colocated.enabled }}
{{- $ctx := dict "root" .root "component" .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "tandem.componentName" $ctx }}
  labels:
    {{- include "tandem.labels" $ctx | trim | nindent 4 }}
    tandem.dev/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "tandem.selectorLabels" (dict "root" .root "component" $pods) | trim | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: {{ $v.ports.grpc }}
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $v.ports.metrics }}
      targetPort: {{ $v.ports.metrics }}
      protocol: TCP
      appProtocol: http
{{- end }}
